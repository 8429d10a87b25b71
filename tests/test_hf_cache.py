"""nats.hf.StaticPolicyCache made for an unknown number of new tokens (``max_new_tokens=None``: eager steps, pools
that grow): the project's KV-cache policies inside transformers' `generate`.

The evicting NAtS cache decodes token for token what the parallel NAtS forward predicts, while holding fewer keys
than it has seen; the full policy equals transformers' own decoding, also past the room planned at the prefill (the
pools grow); a baseline (StreamingLLM) runs on a model without scorers and matches the native decode loop's rule; a
left-padded batch equals each prompt alone; misuse is refused with a message.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_nats import ids, tiny_model  # noqa: E402

from nats.hf import StaticPolicyCache, attach_nats, detach_nats, use_policy_caches  # noqa: E402
from nats.hf.compat import cache_kwargs, generate_through  # noqa: E402

PROMPT, NEW = 40, 12


def growing(model, policy, max_len=PROMPT + NEW, **kw):
    """A cache for an unknown number of new tokens (eager steps, pools that grow), the PyTorch decode kernels."""
    return StaticPolicyCache(model, policy, max_new_tokens=None, max_len=max_len, backend="torch", **kw)


def greedy(model, prompt, cache=None, n=NEW):
    """`n` greedy tokens after `prompt`, through `cache` (None: transformers' own)."""
    return generate_through(model, prompt, cache, n, exact_length=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 2])
def test_nats_cache_generate_equals_parallel_forward_and_evicts(arch, batch):
    model = attach_nats(tiny_model(arch), window=4, init_std=0.5)
    prompt = ids(n=PROMPT, b=batch)
    cache = growing(model, "nats")
    gen = greedy(model, prompt, cache)
    assert gen.shape == (batch, PROMPT + NEW)
    with torch.no_grad():
        full = model(gen).logits  # the parallel NAtS forward (eval: argmax types) over prompt + generated tokens
    assert torch.equal(full[:, PROMPT - 1 : -1].argmax(-1), gen[:, PROMPT:])
    # the NAtS cache really evicts: it holds fewer keys than it has seen, and its sizes are the spec's
    seen = PROMPT + NEW - 1  # the last generated token is never fed back
    assert cache.get_seq_length() == seen
    kept = cache.kept()
    assert kept.shape == (2, batch, 2)
    assert (kept <= seen).all() and (kept < seen).any()
    fr = cache.fractions()
    assert ((fr["area"] > 0) & (fr["area"] < 1)).all() and ((fr["peak"] > 0) & (fr["peak"] <= 1)).all()
    # and decodes as the non-evicting path (transformers' DynamicCache + NAtS mask rows) does
    assert torch.equal(greedy(model, prompt), gen)


def test_full_policy_equals_transformers_decoding():
    model = tiny_model("llama")
    prompt = ids(n=PROMPT, b=2)
    ref = greedy(model, prompt)  # eager attention, DynamicCache
    use_policy_caches(model)
    assert torch.equal(greedy(model, prompt), ref)  # no policy cache: plain attention through the nats function
    cache = growing(model, "full")
    assert torch.equal(greedy(model, prompt, cache), ref)
    assert (cache.kept() == PROMPT + NEW - 1).all()
    # past the free slots the prefill planned, each layer's pool grows (eager steps), the tokens unchanged
    n = 3 * NEW
    cache = growing(model, "full", max_len=PROMPT + n)
    assert torch.equal(greedy(model, prompt, cache, n=n), greedy(model, prompt, n=n))
    assert cache.reallocations() >= len(cache.layers) and (cache.kept() == PROMPT + n - 1).all()
    assert not cache.overflowed()
    detach_nats(model)
    assert model.config._attn_implementation == "eager"


def test_streaming_llm_on_a_model_without_scorers_matches_its_rule():
    """StreamingLLM (sinks + recent window) through generate == a dense masked forward of its visible set."""
    model = use_policy_caches(tiny_model("llama"))
    prompt = ids(n=PROMPT, b=1)
    budget, sinks = 16, 4
    cache = growing(model, "streaming_llm", budget=budget, sinks=sinks)
    gen = greedy(model, prompt, cache)
    assert (cache.kept() == budget).all()
    # query i sees the sinks and the last budget - sinks tokens: the eager model with that mask, one query at a time
    n = gen.shape[1]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    visible = (j <= i) & ((j < sinks) | (j > i - (budget - sinks)))
    mask = torch.zeros(1, 1, n, n).masked_fill(~visible, float("-inf"))
    detach_nats(model)
    with torch.no_grad():
        logits = model(gen, attention_mask=mask).logits
    # the prompt is prefilled by the policy's own rule (StreamingLLM's prefill is the same masked attention)
    assert torch.equal(logits[:, PROMPT - 1 : -1].argmax(-1), gen[:, PROMPT:])


def test_misuse_is_refused():
    plain = tiny_model("llama")
    with pytest.raises(ValueError, match="use_policy_caches"):
        growing(plain, "full", max_len=64)
    use_policy_caches(plain)
    with pytest.raises(ValueError, match="attach_nats"):
        growing(plain, "nats", max_len=64)
    with pytest.raises(ValueError, match="unknown cache policy 'nope'"):
        growing(plain, "nope", max_len=64)
    with pytest.raises(ValueError, match="'full' takes no budget"):
        growing(plain, "full", max_len=64, budget=8)
    model = attach_nats(tiny_model("llama"), window=4)
    cache = growing(model, "nats", max_len=PROMPT)
    with pytest.raises(ValueError, match="max_len"):
        greedy(model, ids(n=PROMPT, b=1), cache)
    with pytest.raises(NotImplementedError, match="beam"):
        greedy_beams = growing(model, "nats")
        with torch.no_grad():
            model.generate(ids(n=8, b=1), max_new_tokens=4, num_beams=2, **cache_kwargs(model, greedy_beams))


@pytest.mark.parametrize("policy", ["full", "nats"])
def test_a_forward_of_several_tokens_continues_the_sequence(policy):
    """A forward of several tokens through a cache that holds a sequence continues it (transformers' meaning of
    ``past_key_values``; the rule's parallel continuation, past the free slots planned: the pools grow) and predicts
    what the parallel forward over the whole sequence predicts."""
    if policy == "nats":
        model = attach_nats(tiny_model("llama"), window=4, init_std=0.5)
    else:
        model = use_policy_caches(tiny_model("llama"))
    seq = ids(n=PROMPT + 3 * NEW, b=2, seed=7)
    cache = growing(model, policy, max_len=seq.shape[1])
    with torch.no_grad():
        first = model(seq[:, :PROMPT], use_cache=True, **cache_kwargs(model, cache)).logits
        assert int(cache.get_seq_length()) == cache.seen == PROMPT
        rest = model(seq[:, PROMPT:], use_cache=True, **cache_kwargs(model, cache)).logits
        full = model(seq).logits
    assert int(cache.get_seq_length()) == cache.seen == seq.shape[1]
    assert cache.reallocations() > 0  # more tokens than the free slots the prefill planned
    got = torch.cat([first, rest], dim=1)
    assert torch.equal(got.argmax(-1), full.argmax(-1))
    if policy == "full":
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
    else:
        assert (cache.kept() < seq.shape[1]).any()  # it evicted on the way


@pytest.mark.parametrize("policy,kw", [("nats", {}), ("full", {}), ("streaming_llm", {"budget": 12})])
def test_left_padded_batch_equals_each_prompt_alone(policy, kw):
    """Made for an unknown number of new tokens, the cache takes a left-padded batch (its rows prefilled over their
    real tokens): each row decodes what its prompt alone decodes, for more new tokens than the free slots planned."""
    model = attach_nats(tiny_model("llama"), window=4, init_std=0.5)
    n = 2 * NEW
    p1, p2 = ids(n=26, b=1, seed=3), ids(n=PROMPT, b=1, seed=4)
    alone = [greedy(model, p, growing(model, policy, max_len=PROMPT + n, **kw), n=n) for p in (p1, p2)]
    pad = torch.zeros(1, PROMPT - 26, dtype=torch.long)
    batch = torch.cat([torch.cat([pad, p1], 1), p2])
    mask = torch.cat([torch.cat([pad, torch.ones_like(p1)], 1), torch.ones_like(p2)])
    cache = growing(model, policy, max_len=PROMPT + n, **kw)
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             **cache_kwargs(model, cache))  # fmt: skip
    assert torch.equal(out[0, PROMPT:], alone[0][0, 26:]) and torch.equal(out[1, PROMPT:], alone[1][0, PROMPT:])
    assert int(cache.kept()[:, 0].max()) <= 26 + n - 1  # the padded row keeps none of its padding


def test_decode_benchmark_smoke(tmp_path):
    """benchmarks/bench_hf_decode.py end to end on a tiny model: transformers' caches and the fixed-capacity ones
    through generate, at two batch sizes, the kept share calibrated, and the equal-memory mode."""
    import json

    from conftest import load_script

    bench = load_script("benchmarks/bench_hf_decode.py")
    methods = ("sdpa_static", "dynamic", "static", "full", "hf_full", "nats")
    argv = ["--smoke", "--out", str(tmp_path), "--methods", *methods, "--kept", "0.5"]
    assert bench.main([*argv, "--equal-memory-gib", "0.002", "--mixed", "3"]) == 0
    rows = json.loads((tmp_path / "bench_hf_decode.json").read_text())["rows"]
    mixed = {r["method"]: r for r in rows if r.get("mixed")}  # the changing workload: the project's caches
    assert set(mixed) == {"full", "hf_full", "nats"} and all(r["ratio"] > 0 for r in mixed.values())
    assert "A changing workload" in (tmp_path / "bench_hf_decode.md").read_text()
    rows = [r for r in rows if not r.get("mixed")]
    main = {(r["method"], r["batch"]): r for r in rows if "equal_memory_gib" not in r}
    assert set(main) == {(m, b) for m in methods for b in (1, 2)}
    assert all(r["generated"] == r["new_tokens"] and r["tokens_per_s"] > 0 for r in rows)
    assert main[("full", 1)]["kept_share"] == 1.0 and main[("nats", 1)]["kept_share"] < 1.0
    held = main[("nats", 2)]["row_kept"]  # how even NAtS' rows are (the decode attention splits each row alike)
    assert 0 < held["min"] <= held["mean"] <= held["max"] and held["layer_max_over_mean"] >= 1
    assert "row_kept" in main[("full", 2)]
    assert main[("static", 2)]["x_static"] == 1.0 and main[("nats", 2)]["x_static"] > 0
    eq = {r["method"]: r for r in rows if "equal_memory_gib" in r}
    assert set(eq) == {"static", "full", "nats"} and all(r["batch"] >= 1 for r in eq.values())
    assert all(r["kv_mib"] <= 0.002 * 1024 or r["batch"] == 1 for r in eq.values())  # the buffers fit the budget
    assert "Equal KV memory" in (tmp_path / "bench_hf_decode.md").read_text()
    # at equal memory, x full is over the fastest full cache at that memory whatever its batch, and the bound is of
    # tokens per byte
    fastest = max((eq["static"], eq["full"]), key=lambda r: r["tokens_per_s"])
    assert eq["nats"]["x_full"] == pytest.approx(eq["nats"]["tokens_per_s"] / fastest["tokens_per_s"])
    per_byte = lambda r: r["batch"] / r["step_gb"]  # noqa: E731
    assert eq["nats"]["limit_x_full"] == pytest.approx(per_byte(eq["nats"]) / per_byte(fastest))
    assert json.loads((tmp_path / "bench_hf_decode.json").read_text())["complete"] is True
    assert all(isinstance(r["cudagraph_skips"], int) for r in rows)
    # against the bandwidth limit: the bytes of a step, the GB/s, their share of the copy measured in the run
    for r in rows:
        assert r["step_gb"] > 0 and r["achieved_gbps"] > 0 and r["share_of_measured"] > 0
    assert main[("full", 2)]["step_gb"] == main[("static", 2)]["step_gb"] == main[("sdpa_static", 2)]["step_gb"]
    assert main[("full", 2)]["limit_x_full"] == 1.0 and main[("nats", 2)]["limit_x_full"] > 1.0
    for b in (1, 2):  # x full: to the fastest full-cache row of the batch
        full_rows = (main[m, b] for m in ("sdpa_static", "dynamic", "static", "full", "hf_full"))
        fastest = max(full_rows, key=lambda r: r["tokens_per_s"])
        assert main[("nats", b)]["full_method"] == fastest["method"]
        assert main[("nats", b)]["x_full"] == pytest.approx(main[("nats", b)]["tokens_per_s"] / fastest["tokens_per_s"])
    text = (tmp_path / "bench_hf_decode.md").read_text()
    assert "bound x full" in text and "GB/s measured" in text and "x StaticCache tok/s" in text


def test_bench_hf_decode_inductor_settings(capsys, monkeypatch):
    """--inductor KEY=VALUE sets torch._inductor.config for the compiled steps (values as Python literals) and goes
    to nats-generate's loop as its step's settings (an argument: the library's defaults stay as they are); a key
    inductor lacks or a word without '=' stops the script with one line naming it, before any model is built."""
    import torch._inductor.config as inductor_config

    from conftest import load_script

    bench = load_script("benchmarks/bench_hf_decode.py")
    # inductor's config is restored by its own patch(): pytest's monkeypatch deletes the setting on undo
    with inductor_config.patch(coordinate_descent_tuning=False, max_autotune_gemm_backends="ATEN"):
        done = bench.set_inductor(["coordinate_descent_tuning=True", "max_autotune_gemm_backends=ATEN,TRITON"])
        assert done == {"coordinate_descent_tuning": True, "max_autotune_gemm_backends": "ATEN,TRITON"}
        assert inductor_config.coordinate_descent_tuning is True
    from nats.hf import StaticPolicyCache, loop

    with inductor_config.patch(combo_kernels=True):
        assert bench.set_inductor(["combo_kernels=False"]) == {"combo_kernels": False}
    assert loop.STEP_INDUCTOR == {"combo_kernels": True}
    seen = []  # the benchmark's generation hands the settings to the loop (which passes them to its compiled step)
    monkeypatch.setattr(loop, "generate", lambda *a, **kw: seen.append(kw.get("inductor")) or a[1])
    model = use_policy_caches(tiny_model("llama"))
    prompt = torch.zeros(1, 3, dtype=torch.long)
    bench.generate(model, prompt, StaticPolicyCache(model, "full", max_new_tokens=2), 2, method="full",
                   inductor={"combo_kernels": False})  # fmt: skip
    bench.timed_request(model, prompt, lambda: StaticPolicyCache(model, "full", max_new_tokens=2), 2, "full",
                        torch.device("cpu"), {"max_autotune": True})  # fmt: skip
    assert seen == [{"combo_kernels": False}, {"max_autotune": True}]
    for word, says in (("no_such_setting=1", "has no setting 'no_such_setting'"), ("coordinate", "give KEY=VALUE")):
        assert bench.main(["--smoke", "--inductor", word]) == 2
        out = capsys.readouterr().out.strip()
        assert len(out.splitlines()) == 1 and says in out, out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_gptfast_decoder_equals_static_cache_generate(attention):
    """benchmarks/gptfast_decode.py (the gpt-fast-style full cache of the benchmark) decodes the greedy tokens of
    model.generate with transformers' StaticCache, twice in a row from the same buffers, and with the model's
    projections fused."""
    from conftest import load_script

    bench = load_script("benchmarks/bench_hf_decode.py")
    args = bench.argparse.Namespace(model=None, smoke=True, prompt=[150], new=10)
    model = bench.build_model(args, torch.device("cpu"), torch.float32)
    model.config._attn_implementation = "sdpa"
    prompt = torch.randint(0, model.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    ref = greedy(model, prompt, transformers.StaticCache(config=model.config, max_cache_len=160), n=10)
    dec = bench._gptfast().GptFastDecoder(model, 2, 160, attention, compile=False)
    assert torch.equal(dec.generate(prompt, 10), ref) and torch.equal(dec.generate(prompt, 10), ref)
    from nats.hf.fused import fuse_projections

    fuse_projections(model)  # q/k/v as one product, as gpt-fast's wqkv (the benchmark's rows)
    assert torch.equal(dec.generate(prompt, 10), ref)
    assert dec.kv_nbytes() == 2 * 2 * 2 * 3 * 160 * 8 * 4  # K and V: layers x batch x KV heads x slots x D x 4 B


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_gptfast_flex_decoder_replays_its_graph_after_the_projects_loop():
    """After nats.hf.loop has marked its steps (CUDA-graph trees then stop starting replays by themselves), the
    gpt-fast-style flex decoder still replays one recorded graph per shape: a second generation records none, and
    decodes transformers' StaticCache tokens (float32)."""
    from conftest import load_script
    from nats.hf import StaticPolicyCache, use_policy_caches
    from nats.hf.loop import cudagraph_recordings, generate

    bench = load_script("benchmarks/bench_hf_decode.py")
    torch.manual_seed(0)  # the benchmark's tiny model at head dim 16, the least compiled FlexAttention takes
    cfg = transformers.LlamaConfig(**dict(bench.TINY, hidden_size=144, max_position_embeddings=256))
    with torch.device("cuda"):
        model = use_policy_caches(transformers.LlamaForCausalLM(cfg).eval())  # routed for the project's loop
    prompt = torch.randint(0, model.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0)).cuda()
    generate(model, prompt, StaticPolicyCache(model, "full", max_new_tokens=10), 10, compile=True)  # marks steps
    model.config._attn_implementation = "sdpa"  # transformers' own attention for its StaticCache
    ref = greedy(model, prompt, transformers.StaticCache(config=model.config, max_cache_len=160), n=10)
    dec = bench._gptfast().GptFastDecoder(model, 2, 160, "flex", compile=True)
    assert torch.equal(dec.generate(prompt, 10), ref)  # compiled and recorded here
    before = cudagraph_recordings()
    assert torch.equal(dec.generate(prompt, 10), ref)
    assert cudagraph_recordings() == before


def test_decode_benchmark_model_shapes_weight_bytes():
    """--model-shape builds each shape (here on the meta device, no memory); the bytes a decode step reads of its
    weights: every parameter once, of an untied embedding table one row per sequence."""
    from conftest import load_script
    from nats.cache import roofline

    bench = load_script("benchmarks/bench_hf_decode.py")
    counts = {"smollm2-135m": 134515008, "llama-3.2-1b": 1235814400, "llama-3.1-8b": 8030261248}
    for shape, n in counts.items():
        args = bench.argparse.Namespace(model=None, smoke=False, prompt=[1024], new=8, model_shape=shape)
        model = bench.build_model(args, torch.device("meta"), torch.bfloat16)
        assert sum(p.numel() for p in model.parameters()) == n
        table = 0 if model.config.tie_word_embeddings else 128256 * 4096 - 4096  # all rows of the table but one
        assert roofline.weight_bytes(model, 1) == 2 * (n - table)


def test_decode_benchmark_batch_fits_the_memory_budget():
    """The equal-memory batch starts from an estimate of one sequence's bytes; where the estimate is too low (a
    NAtS pool holds what the prompt's types keep) the batch shrinks until the buffers it allocates fit."""
    from conftest import load_script

    bench = load_script("benchmarks/bench_hf_decode.py")
    args = bench.argparse.Namespace(model=None, smoke=True, prompt=[96], new=8, slow_new=8, window=8, inductor={})
    model = bench.build_model(args, torch.device("cpu"), torch.float32)
    attach_nats(model, window=8)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, 96), generator=gen)
    bench.calibrate(model, prompt, 0.5)
    cache = bench.cache_maker(model, "nats", 96, 8, 0.5)()
    bench.generate(model, prompt, cache, 1)
    per_seq = bench.kv_bytes(cache)
    budget = 6 * per_seq
    B, prompt = bench.fit_batch(model, "nats", 96, 0.5, budget, per_seq / 3, args, gen, torch.device("cpu"))
    assert prompt.shape == (B, 96) and 1 <= B < 18  # the estimate (18) did not fit
    cache = bench.cache_maker(model, "nats", 96, 8, 0.5)()
    bench.generate(model, prompt, cache, 1)
    assert bench.kv_bytes(cache) <= budget


def test_decode_benchmark_keeps_its_rows_when_stopped(tmp_path, monkeypatch):
    """A run stopped part way (a time limit) leaves the rows it measured in its table, marked incomplete."""
    import json

    from conftest import load_script

    bench = load_script("benchmarks/bench_hf_decode.py")
    real, calls = bench.run, []

    def run_then_stop(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what a SIGINT / the time limit does to the third measurement
        return real(*a, **kw)

    monkeypatch.setattr(bench, "run", run_then_stop)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--smoke", "--out", str(tmp_path), "--methods", "static", "full", "--batch", "1", "2"])
    saved = json.loads((tmp_path / "bench_hf_decode.json").read_text())
    assert saved["complete"] is False and [(r["method"], r["batch"]) for r in saved["rows"]] == [
        ("static", 1),
        ("full", 1),
    ]
    text = (tmp_path / "bench_hf_decode.md").read_text()
    assert "| 96 | 1 | full |" in text and "incomplete" in text


def test_decode_benchmark_row_out_of_memory_goes_on(tmp_path, monkeypatch):
    """A row that runs out of GPU memory (the full cache at 8B, batch 8 x 32k on an H200) is said under the table;
    the other rows are measured."""
    import json

    from conftest import load_script

    bench = load_script("benchmarks/bench_hf_decode.py")
    real = bench.run

    def full_too_large(model, method, *a, **kw):
        if method == "full":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB.")
        return real(model, method, *a, **kw)

    monkeypatch.setattr(bench, "run", full_too_large)
    assert bench.main(["--smoke", "--out", str(tmp_path), "--methods", "full", "nats", "--kept", "0.5"]) == 0
    saved = json.loads((tmp_path / "bench_hf_decode.json").read_text())
    assert [(r["method"], r["batch"]) for r in saved["rows"]] == [("nats", 1), ("nats", 2)] and saved["complete"]
    text = (tmp_path / "bench_hf_decode.md").read_text()
    assert "Not measured: prompt 96, batch 1, full: out of GPU memory; prompt 96, batch 2, full: out of" in text


def test_decode_benchmark_profile_tables(tmp_path):
    """--profile writes, per method, the kernel tables of a prefill and of decode steps, each also by host time
    (where a CUDA-graphed decode shows as cudaGraphLaunch)."""
    from conftest import load_script

    bench = load_script("benchmarks/bench_hf_decode.py")
    assert bench.main(["--smoke", "--out", str(tmp_path), "--methods", "full", "--profile"]) == 0
    text = (tmp_path / "profile_full_None_b1_n96.txt").read_text()
    assert text.count("### the same by host time") == 2 and "prefill + decode steps" in text


@pytest.mark.slow  # a GPU benchmark's CPU smoke run: make test-all
def test_host_benchmark_smoke(tmp_path):
    """benchmarks/bench_hf_host.py on a tiny model on the CPU (generate made to compile the step): both caches'
    rows, the NAtS cache reading its packed buffers (4 tensors per layer, one position counter for all layers)
    against StaticCache's 3 per layer."""
    import json

    from conftest import load_script

    bench = load_script("benchmarks/bench_hf_host.py")
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "bench_hf_host.json").read_text())["rows"]}
    assert set(rows) == {"static", "nats", "nats_torch_prefill"}
    assert rows["static"]["cache_tensors"] == 3 * 2 and rows["nats"]["cache_tensors"] == 4 * 2 + 1  # 2 layers
    assert all(r["guard_ms"] > 0 and r["prefill_aten_calls"] > 0 and r["prefill_ms"] > 0 for r in rows.values())
    assert all(0 < r["prefill_attention_ms"] < r["prefill_ms"] for r in rows.values())  # the attention's host time
    parts = {name: r["prefill_attention_parts_ms"] for name, r in rows.items()}
    assert all(v > 0 for v in parts["nats"].values()) and not any(parts["static"].values())  # NAtS' parts only
    timed = parts["nats"]["types_and_attention"] + parts["nats"]["pool_fill_and_allocate"]
    assert timed < rows["nats"]["prefill_attention_ms"]  # parts of the attention function's time
    assert "| nats | 9 |" in (tmp_path / "bench_hf_host.md").read_text()
    assert "_prefill" in (tmp_path / "python_prefill_nats.txt").read_text()  # EngineCache._prefill's line


def test_bench_times_the_decode_steps_apart_from_the_prefill(monkeypatch):
    """A timed request is one generation: the prefill until `on_prefill`, the decode steps after it (not the
    difference with a second, one-token generation, whose prefill's jitter moved the decode time)."""
    import time

    from conftest import load_script

    bench = load_script("benchmarks/bench_hf_decode.py")
    calls = []

    def fake(model, prompt, cache, n, method=None, on_prefill=None, inductor=None):
        calls.append(n)
        time.sleep(0.2)  # the prefill
        on_prefill()
        time.sleep(0.05)  # the decode steps
        return prompt

    monkeypatch.setattr(bench, "generate", fake)
    prefill_s, decode_s, _, cache = bench.timed_request(None, torch.zeros(1, 3), lambda: "cache", 8, "full",
                                                        torch.device("cpu"))  # fmt: skip
    assert calls == [8] and cache == "cache"
    assert 0.2 <= prefill_s < 0.25 and 0.05 <= decode_s < 0.1
