# GPU deployment image: the rollout app on vLLM, served by Ray Serve.
#   docker build -t rollout-profiler .
#   export ROLLOUT_PROFILER_CONTROL_TOKEN=$(openssl rand -hex 24)   # keep it: every control call needs it
#   docker run --gpus all --shm-size 8g -p 127.0.0.1:8000:8000 \
#     -e ROLLOUT_PROFILER_CONTROL_TOKEN \
#     -v /path/to/checkpoint:/models/policy:ro -v /path/to/data:/data rollout-profiler
# The app listens on 0.0.0.0 inside the container, so it refuses to start without a control
# token; config/serve.vllm-gpu.yaml reads it from ROLLOUT_PROFILER_CONTROL_TOKEN.
# It runs as the user `rollout` (uid 10001, tini as PID 1): the mounted /data must be writable by
# that uid (`sudo chown -R 10001 /path/to/data`).
# See docs/operations.md ("Docker").
FROM vllm/vllm-openai:v0.33.0

# tini runs as PID 1 so the processes Ray starts and leaves are reaped (Kubernetes has no --init).
# Before the project's files, so a code change does not rerun apt.
RUN apt-get update && apt-get install -y --no-install-recommends tini && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --user-group rollout \
 && mkdir -p /data/traces /data/weights && chown -R rollout:rollout /data

WORKDIR /opt/rollout-profiler
COPY pyproject.toml README.md ./
COPY profiling ./profiling
COPY serve_app ./serve_app
COPY trainer ./trainer
COPY config ./config
# The base image already has vLLM and its CUDA torch; installing the project keeps them.
RUN python3 -m pip install --no-cache-dir .

ENV HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 HOME=/home/rollout
USER rollout
EXPOSE 8000 8002
# Healthy once every replica serves (/ready, docs/operations.md#readiness); replicas build their
# engines for minutes first.
HEALTHCHECK --interval=30s --timeout=10s --start-period=900s --retries=3 \
  CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=8)" || exit 1
# The base image's entrypoint is `vllm serve`; this image runs Ray Serve instead, under tini.
ENTRYPOINT ["/usr/bin/tini", "--"]
# --address local: always a fresh private cluster, never a stale one left in a restarted container.
CMD ["serve", "run", "--address", "local", "config/serve.vllm-gpu.yaml"]
