"""SkyRL 0.3.0's own `RemoteInferenceClient` driving the app as it drives vLLM's server. Runs in
a Python 3.12 virtual environment of its own (the client does not import on Python 3.11), started
by tests/integration/test_skyrl_client.py; imports nothing of the project. Prints one JSON object:
what each call of the client returned.

    python driver.py <app url> <served model> <weights path under weights_dir> <version>
"""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient

GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def drive(url: str, model: str, weights: str, version: int) -> dict:
    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model)
    got: dict = {}
    try:
        got["world_size"] = list(await client.get_world_size())
        got["tokens"] = await client.tokenize(["One two three"])
        got["text"] = await client.detokenize(got["tokens"])
        prompt = got["tokens"][0]
        batch = {"prompt_token_ids": [prompt, prompt], "sampling_params": {"max_tokens": 6, "logprobs": 1, **GREEDY}}
        got["generate"] = dict(await client.generate(batch))  # type: ignore[arg-type]
        got["completion"] = await client.completion({"json": {"prompt": "One two", "max_tokens": 4}})
        chat = {"messages": [{"role": "user", "content": "One two"}], "max_tokens": 4}
        got["chat"] = await client.chat_completion({"json": chat})
        # A weight sync as SkyRL brackets it, with a request in flight: pause(keep), publish, resume.
        # On an idle machine the tiny model may finish the request before the pause lands: then
        # resume and try again, until the pause catches it in flight.
        long = {"prompt_token_ids": [prompt], "sampling_params": {"max_tokens": 400, **GREEDY}}
        for attempt in range(10):
            running = asyncio.ensure_future(client.generate(long))  # type: ignore[arg-type]
            await asyncio.sleep(0.05 * attempt)
            got["pause"] = await client.pause(mode="keep")
            got["pause_attempts"] = attempt + 1
            if not running.done():
                break
            await client.resume()
        async with aiohttp.ClientSession() as http:  # the trainer's publish, as the app takes it
            async with http.post(f"{url}/weights/update", json={"version": version, "path": weights}) as r:
                got["update"] = {"status": r.status, "body": await r.json()}
            async with http.get(f"{url}/is_paused") as r:
                got["paused_after_update"] = await r.json()
            await asyncio.sleep(1.0)  # the unpaused engine makes the whole request in well under this
            got["in_flight_during_pause"] = not running.done()
            got["resume"] = await client.resume()
            got["in_flight"] = dict(await running)
            async with http.get(f"{url}/is_paused") as r:
                got["paused_after_resume"] = await r.json()
        got["reset"] = await client.reset_prefix_cache(reset_running_requests=True)
    finally:
        await client.teardown()
    return got


if __name__ == "__main__":
    url, model, weights, version = sys.argv[1:5]
    print(json.dumps(asyncio.run(drive(url, model, weights, int(version)))))
