"""nats-generate with a transformers model (hf_model=...): every decodable policy through the engine's transformers
cache (StaticPolicyCache); NAtS from a scorer file; the text equals greedy decoding through the same cache by hand."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import compose  # noqa: E402
from nats.generate import generate_report  # noqa: E402
from nats.hf import attach_nats, nats_state_dict  # noqa: E402
from nats.hf.pretrained import save_tiny_random_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_random_llama(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    attach_nats(model, window=4, init_std=0.5)
    torch.save(nats_state_dict(model), folder / "scorers.pt")
    return folder


def cfg(tiny, tmp_path, *overrides):
    return compose(
        ["hf_model=smollm2_135m", f"hf_model.name_or_path={tiny}", "prompt='Once upon a time there was'",
         "max_new_tokens=6", "device=cpu", *overrides],
        tmp_path,
        config_name="generate",
    )  # fmt: skip


@pytest.mark.parametrize(
    "policy,extra,cache",
    [("full", [], "StaticPolicyCache"), ("streaming_llm", ["budget=6"], "StaticPolicyCache"),
     ("h2o", ["budget=6"], "StaticPolicyCache")],
)  # fmt: skip
def test_policies(tiny, tmp_path, policy, extra, cache):
    report = generate_report(cfg(tiny, tmp_path, f"policy={policy}", *extra))
    assert report["cache"] == cache and len(report["tokens"][0]) == 6
    assert report["texts"][0].startswith("Once upon a time there was")
    s = report["stats"]
    assert (s["kept_max"] == s["processed"]) == (policy == "full")


def test_nats_scorers_equal_growing_cache_by_hand(tiny, tmp_path):
    report = generate_report(cfg(tiny, tmp_path, "policy=nats", f"scorers={tiny}/scorers.pt", "window=4"))
    from nats.hf import StaticPolicyCache, load_nats_state_dict
    from nats.hf.compat import cache_kwargs

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    attach_nats(model, window=4)
    load_nats_state_dict(model, torch.load(tiny / "scorers.pt"))
    model.eval()
    ids = tok("Once upon a time there was", return_tensors="pt").input_ids
    cache = StaticPolicyCache(model, "nats", max_new_tokens=None, max_len=ids.shape[1] + 6, backend="torch")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, **cache_kwargs(model, cache))  # fmt: skip
    assert report["cache"] == "StaticPolicyCache"
    assert report["tokens"][0] == out[0, ids.shape[1] :].tolist()
    assert report["stats"]["kept_max"] < report["stats"]["processed"]


def test_nats_without_scorers_is_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="scorers="):
        generate_report(cfg(tiny, tmp_path, "policy=nats"))
