"""NAtS as a kvpress press (`nats.kvpress.NAtSPress`, docs/kvpress.md) on a tiny random Llama with ChatML (kvpress'
pipeline then feeds the question as one forward of several tokens) and random NAtS scorers (W = 8) saved as a
fine-tuning run's scorers.pt, on the CPU, greedy. Skipped where kvpress is not installed.

Checked:
* through kvpress' ``KVPressTextGenerationPipeline`` the press generates the tokens that nats-eval-hf's NAtS cache path
  generates (`nats.finetune.evaluate.generate_one` through a `nats.hf.StaticPolicyCache` of policy ``nats``) on the same
  long-context examples, with the same logits (to 1e-5) and the same KV kept per layer and KV head at the end: with
  the whole prompt prefilled (nats-eval-hf's protocol) and with the context prefilled and the question continuing it
  (kvpress' protocol, as the pipeline runs); the dense model (no press, SDPA) answers otherwise, so the comparison
  tells NAtS apart;
* after the prefill kvpress' cache holds fewer positions than the prompt, at least what its fullest KV head keeps
  (per-head lengths differ: the rest is masked per head);
* the run's adapter folder (nats.hf.adapter_export) as ``scorers=`` generates what its scorers.pt does;
* scorers trained for another model (other width; other depth; an adapter folder of another model) and a model without
  scorers are refused in one line, and a failed load leaves no scorers attached.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("kvpress")

from helpers import tiny_model_and_scorers  # noqa: E402
from nats.finetune import evaluate as E  # noqa: E402
from nats.finetune.kvpress_methods import plain_attention  # noqa: E402
from nats.hf import StaticPolicyCache, attach_nats, is_attached, nats_state_dict  # noqa: E402
from nats.hf.compat import cache_kwargs  # noqa: E402
from nats.hf.pretrained import save_tiny_random_llama  # noqa: E402

# at module level: importing kvpress wraps the attention functions registered by then, "nats" among them (a TypeError in
# every NAtS attention call afterwards, nats/kvpress.py says why), and nats.kvpress puts "nats" back; a test process
# (each pytest-xdist worker) imports every test module before it runs a test, so the whole suite runs with it back
from nats.kvpress import NAtSPress  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # conftest.py
    # kvpress' pipeline passes the cache as past_key_values, which transformers 5.24 takes with this warning
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
]
WINDOW, NEW = 8, 12  # NAtS' window; the tokens generated per example


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """The tiny model (ChatML tokenizer) and the scorers of a "fine-tuning run" (random weights, W in its
    nats_stats.json), as nats-eval-hf reads them."""
    root = tiny_model_and_scorers(tmp_path_factory.mktemp("tiny_llama_press"), WINDOW, chat=True)
    config = f"hf_model:\n  name_or_path: {root}\nmodule:\n  window: {WINDOW}\n"
    (root / "finetune_run" / ".hydra" / "config.yaml").write_text(config)
    return root


@pytest.fixture(scope="module")
def setup(pretrained):
    """The model (its scorers attached by the press at its first use), the pipeline and the examples: passkey and
    niah of 300-320 tokens, split before their question into kvpress' context and question."""
    from kvpress import KVPressTextGenerationPipeline

    from nats.data.longctx.tasks import build_examples, question_start

    tok = transformers.AutoTokenizer.from_pretrained(pretrained)
    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained).eval()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok)
    examples = []
    for ex in build_examples(tok, tasks=["passkey", "niah"], num_examples=1, max_length=320, min_length=300):
        n = question_start(ex, tok)
        examples.append((tok.decode(ex.prompt_ids[:n]), tok.decode(ex.prompt_ids[n:])))
    press = NAtSPress(scorers=pretrained / "finetune_run" / "scorers.pt")
    return model, pipe, press, examples


class Logits:
    """The last position's logits of every lm_head call (a greedy token each: the prefill through ``model.model``
    calls none)."""

    def __init__(self, model):
        self.rows: list[torch.Tensor] = []
        self.handle = model.lm_head.register_forward_hook(lambda m, a, out: self.rows.append(out[0, -1].clone()))

    def take(self) -> torch.Tensor:
        rows, self.rows = self.rows, []
        return torch.stack(rows)


def pipeline_run(pipe, context: str, question: str, press) -> tuple[list[int], torch.Tensor, str]:
    """kvpress' pipeline on one example: the generated ids (each step's argmax), their logits and its answer."""
    logits = Logits(pipe.model)
    try:
        answer = pipe(context, question=question, press=press, max_new_tokens=NEW)["answer"]
        rows = logits.take()
    finally:
        logits.handle.remove()
    return rows.argmax(-1).tolist(), rows, answer


@pytest.fixture(scope="module")
def press_runs(setup):
    """Per example: the press's ids, logits, answer, and its KV kept per layer and row, and tokens seen."""
    model, pipe, press, examples = setup
    out = []
    for context, question in examples:
        ids, logits, answer = pipeline_run(pipe, context, question, press)
        out.append({"ids": ids, "logits": logits, "answer": answer, "kept": press.kept(), "seen": press.seen})
    return out


def project_run(model, pipe, context: str, question: str, protocol: str):
    """nats-eval-hf's NAtS cache path (`nats.finetune.evaluate.evaluate_one`) on the pipeline's own token ids: a
    StaticPolicyCache of policy nats (torch backend, PyTorch prefill), then greedy generation; protocol ``kvpress``
    prefills the context first and generation continues it with the question."""
    inputs = pipe.preprocess(context, questions=[question], answer_prefix="", max_context_length=10**9)
    context_ids, question_ids = inputs["context_ids"][0].tolist(), inputs["questions_ids"][0][0].tolist()
    prompt = context_ids + question_ids
    cache = StaticPolicyCache(model, "nats", max_len=len(prompt) + NEW, backend="torch", prefill_kernel="torch")
    logits = Logits(model)
    try:
        if protocol == "kvpress":
            with torch.no_grad():
                model(torch.tensor([context_ids]), use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
            cache.history = torch.tensor([context_ids])
            logits.take()  # the context's forward is not a generated token
        generated = E.generate_one(model, prompt, NEW, cache)
        rows = logits.take()
    finally:
        logits.handle.remove()
    return generated, rows, cache


@pytest.mark.parametrize("protocol", ["project", "kvpress"])
def test_press_in_kvpress_pipeline_generates_what_the_nats_cache_generates(setup, press_runs, protocol):
    model, pipe, press, examples = setup
    for (context, question), ours in zip(examples, press_runs):
        generated, logits, cache = project_run(model, pipe, context, question, protocol)
        assert ours["ids"] == generated  # the same greedy tokens ...
        torch.testing.assert_close(ours["logits"], logits, rtol=0, atol=1e-5)  # ... from the same logits
        assert ours["answer"] == pipe.tokenizer.decode(generated, skip_special_tokens=True)
        # the same KV kept per layer and KV head after the same tokens, fewer than seen (NAtS evicted)
        assert ours["seen"] == int(cache.get_seq_length())
        assert torch.equal(ours["kept"], cache.kept().reshape(ours["kept"].shape).to(ours["kept"].dtype))
        assert int(ours["kept"].max()) < ours["seen"]


def test_dense_attention_answers_otherwise(setup, press_runs):
    """The control: without the press (transformers' SDPA, every key) the logits differ, so the comparison above
    tells NAtS' keys apart from the full cache's."""
    model, pipe, _, examples = setup
    with plain_attention(model):
        dense = [pipeline_run(pipe, context, question, None)[1] for context, question in examples]
    assert max(float((ours["logits"] - d).abs().max()) for ours, d in zip(press_runs, dense)) > 1e-2


def test_kvpress_cache_holds_what_some_head_keeps(pretrained, setup, press_runs):
    """After a prefill under the press, kvpress' DynamicCache holds, per layer, the positions some KV head keeps: fewer
    than the prompt, at least the fullest head's (the others' extra positions are masked in their attention). A new
    press of the same scorers takes the model as the first one left it (a press per call)."""
    from transformers import DynamicCache

    model, pipe, _, examples = setup
    press = NAtSPress(scorers=pretrained / "finetune_run" / "scorers.pt")
    inputs = pipe.preprocess(examples[0][0], questions=[""], answer_prefix="", max_context_length=10**9)
    ids = inputs["context_ids"]
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, **cache_kwargs(model.model, cache))
    kept, held = press.kept(), press.held_tokens()
    assert press.seen == ids.shape[1]
    for i, layer in enumerate(cache.layers):
        assert layer.keys.shape[2] == layer.values.shape[2] == held[i] < ids.shape[1]
        assert int(kept[i].max()) <= held[i] <= int(kept[i].sum())
    assert len({int(n) for n in kept.flatten()}) > 1  # KV heads keep different numbers: per-head lengths
    assert 0 < press.compression_ratio < 1
    with pytest.raises(AttributeError, match="read-only"):
        press.compression_ratio = 0.5


def test_an_adapter_folder_is_the_same_press(pretrained, setup, press_runs, tmp_path):
    """NAtSPress(scorers=<adapter folder>) (nats.hf.adapter_export of the run) generates what its scorers.pt does."""
    from kvpress import KVPressTextGenerationPipeline

    from nats.hf.adapter_export import export_nats_adapter

    _, _, _, examples = setup
    adapter = export_nats_adapter(pretrained / "finetune_run", tmp_path / "adapter")
    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained).eval()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=transformers.AutoTokenizer.from_pretrained(pretrained))
    ids, logits, _ = pipeline_run(pipe, *examples[0], NAtSPress(scorers=adapter))
    assert ids == press_runs[0]["ids"]
    torch.testing.assert_close(logits, press_runs[0]["logits"], rtol=0, atol=1e-5)


def _other_scorers(folder: Path, **sizes) -> Path:
    """A scorers.pt trained (randomly) on a Llama of other sizes (hidden 64 / 2 layers unless given)."""
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=sizes.get("hidden", 64), intermediate_size=128,
                                      num_hidden_layers=sizes.get("layers", 2), num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    other = attach_nats(transformers.LlamaForCausalLM(config), window=WINDOW)
    folder.mkdir()
    torch.save(nats_state_dict(other), folder / "scorers.pt")
    (folder / "nats_stats.json").write_text(json.dumps({"window": WINDOW}))
    return folder / "scorers.pt"


@pytest.mark.parametrize(
    ("sizes", "match"),
    [({"hidden": 32}, r"do not fit this model .*is \[6, 32\] there, \[6, 64\] here"), ({"layers": 3}, "does not fit")],
    ids=["other_width", "other_depth"],
)
def test_scorers_of_another_model_are_refused_in_one_line(pretrained, setup, tmp_path, sizes, match):
    from kvpress import KVPressTextGenerationPipeline

    _, _, _, examples = setup
    tok = transformers.AutoTokenizer.from_pretrained(pretrained)
    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained).eval()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok)
    press = NAtSPress(scorers=_other_scorers(tmp_path / "other_run", **sizes))
    with pytest.raises(ValueError, match=f"^NAtSPress: .*{match}") as err:
        pipe(examples[0][0], question=examples[0][1], press=press, max_new_tokens=2)
    assert "\n" not in str(err.value)
    assert not is_attached(model)  # nothing half-loaded is left behind
    with pytest.raises(ValueError, match=r"^NAtSPress needs NAtS scorers: NAtSPress\(scorers=") as err:
        pipe(examples[0][0], question=examples[0][1], press=NAtSPress(), max_new_tokens=2)
    assert "\n" not in str(err.value)


def test_an_adapter_folder_of_another_model_is_refused_in_one_line(pretrained, setup, tmp_path):
    from kvpress import KVPressTextGenerationPipeline

    from nats.hf.adapter_export import export_nats_adapter

    _, _, _, examples = setup
    adapter = export_nats_adapter(pretrained / "finetune_run", tmp_path / "adapter")
    other = save_tiny_random_llama(tmp_path / "other", n_layer=3, chat=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(other).eval()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=transformers.AutoTokenizer.from_pretrained(other))
    with pytest.raises(ValueError, match="^NAtSPress: .* was made for .* not this model") as err:
        pipe(examples[0][0], question=examples[0][1], press=NAtSPress(scorers=adapter), max_new_tokens=2)
    assert "\n" not in str(err.value) and not is_attached(model)
