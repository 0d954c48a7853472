"""TRL's own client against the app on the embedded engine (docs/frameworks/trl.md): the TRL
contract (trl_contract.py), TRL's default host, and the world size of a 2-replica app."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from trl.generation.vllm_client import VLLMClient
from trl_contract import (  # noqa: F401 - collected here, on the embedded engine
    test_trl_chat_answers_with_the_rendered_prompt_and_logprobs,
    test_trl_generate_takes_every_sampling_field_and_ranks_the_alternatives,
    test_trl_generate_text_and_token_id_prompts_with_n_and_the_sampled_tokens_logprob,
    test_trl_nccl_weight_sync_is_refused_with_trls_own_message,
    test_trl_reset_prefix_cache,
    test_trl_sequence_logprobs_score_what_generate_sampled,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trl(app) -> VLLMClient:
    return VLLMClient(base_url=app.base_url, connection_timeout=60)


def test_trl_connects_and_finds_the_served_model(trl, app):
    assert trl.model == "tiny-llama"
    # TRL's default host, 0.0.0.0, passes the loopback Host guard.
    port = urlsplit(app.base_url).port
    assert VLLMClient(host="0.0.0.0", server_port=port, connection_timeout=10).model == "tiny-llama"


def test_trl_world_size_and_server_info(trl):
    assert trl.get_world_size() == 2, "two replicas, one engine worker each"
    info = trl.get_server_info()
    assert info["weight_transfer_config"] is None
    assert info["parallel_config"]["data_parallel_size"] == 2
