"""DMS (nats/attention/dms.py, nats/cache/policies/dms.py, docs/dms.md): the delayed-eviction mask of inference
equals the engine cache's visible set step by step (a slow reference loop), the training mask is its soft form, the
auxiliary loss asks for the scheduled share of evictions, and a tiny GPT trains with it through nats-train's build
and decodes as its eval forward."""

from __future__ import annotations

import csv

import pytest
import torch

from conftest import compose
from nats.attention.dms import EVICT, KEEP, DMSAttention, soft_mask
from nats.attention.registry import AttentionDims
from nats.cache.decode import policy_logits
from nats.cache.engine import EngineLayer
from nats.cache.registry import get_cache_class
from nats.cache.rule import RuleContext
from nats.callbacks import CompressionSchedule
from nats.models.gpt import GPT, GPTConfig
from nats.train import build

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

W, HQ, HKV, D = 3, 4, 2, 8


def core(**kw) -> DMSAttention:
    """A DMS core bound to a random query projection (32 -> Hq * D)."""
    dims = AttentionDims(n_embd=32, n_head=HQ, n_kv_head=HKV, head_dim=D, block_size=64, layer_idx=0, n_layer=2)
    c = DMSAttention(dims, window=W, alpha_scale=10.0, alpha_offset=0.0, backend="reference", **kw)
    torch.manual_seed(3)
    c.bind_query(torch.nn.Linear(32, HQ * D).double())
    return c.double().eval()


def qkv(n: int, seed: int = 0):
    """Random q, k, v and the block input x the decisions are read from."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV))
    return q, k, v, torch.randn(1, n, 32, generator=g, dtype=torch.float64)


def visible(evict: torch.Tensor, i: int) -> list[int]:
    """The reference: the keys query i attends to, ``{j <= i : kept, or evicted and i - j < W}``."""
    return [j for j in range(i + 1) if not bool(evict[j]) or i - j < W]


def test_the_cache_holds_the_delayed_eviction_set_at_every_step():
    """A DMS engine layer (prefill of P tokens, then one step a token): after query i it holds exactly the keys the
    next query sees besides itself, ``{j <= i : kept, or i + 1 - j < W}``, and each output is the softmax attention
    over `visible` (a loop over the positions)."""
    P, N = 5, 17
    c = core()
    q, k, v, x = qkv(N)
    types = c.hard_types(x)  # [1, Hkv, N]
    assert (types == EVICT).any() and (types == KEEP).any()
    layer = EngineLayer(get_cache_class("dms").rule(), RuleContext(0, 1, None, True), c)
    ys = [layer.prefill(q[:, :, :P], k[:, :, :P], v[:, :, :P], x[:, :P])]
    for i in range(P, N):
        layer.maintain()
        s = slice(i, i + 1)
        ys.append(layer.step(q[:, :, s].reshape(HKV, HQ // HKV, D), k[:, :, s][:, :, 0], v[:, :, s][:, :, 0],
                             x[:, i]).reshape(1, HQ, 1, D))  # fmt: skip
        for h in range(HKV):  # the keys the row holds, found by value among the inputs
            r = h  # batch 1: row = KV head
            seg = layer.k_pool[layer.start[r] : layer.start[r] + layer.length[r]]
            ring = layer.ring_k[r][layer.ring_valid[r]]
            held = sorted(int((k[0, h] == key).all(-1).nonzero()) for key in torch.cat([seg, ring]))
            evict = types[0, h] == EVICT
            expect = [j for j in range(i + 1) if not bool(evict[j]) or i + 1 - j < W]
            assert held == expect, (i, h, held, expect)
    y = torch.cat(ys, dim=2)
    group = HQ // HKV
    for i in range(N):  # the outputs: attention over the reference set
        for hq in range(HQ):
            h = hq // group
            js = visible(types[0, h] == EVICT, i)
            att = torch.softmax(q[0, hq, i] @ k[0, h, js].T / D**0.5, -1) @ v[0, h, js]
            torch.testing.assert_close(y[0, hq, i], att, rtol=1e-9, atol=1e-9)


def test_the_training_mask_is_the_soft_delayed_eviction():
    """alpha = 0: causal attention; alpha = 1 for a token: no query W or more positions after it sees it, the
    nearer ones do."""
    n = 8
    q = torch.zeros(1, HQ, n, D, dtype=torch.float64)
    alpha = torch.zeros(1, HKV, n, dtype=torch.float64)
    m = soft_mask(alpha, W, q)
    assert m.shape == (1, HQ, n, n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(m[0, 0] == 0, causal) and bool(torch.isinf(m[0, 0][~causal]).all())
    alpha[0, 1, 2] = 1.0  # token 2 of KV head 1 evicted, query heads 2 and 3
    m = soft_mask(alpha, W, q)
    col = m[0, 2, :, 2]
    assert bool((col[2 : 2 + W] == 0).all()) and bool((col[2 + W :] < -10).all())
    assert bool((m[0, 0, :, 2][2:] == 0).all())  # KV head 0 keeps it


def test_the_auxiliary_loss_asks_for_the_scheduled_share():
    c = core(target_cr=1.0).train()
    q, k, v, x = qkv(12)
    out = c(q, k, v, x)
    assert float(out.aux_loss) == 0  # ratio 1: no eviction asked
    c.target_cr = 8.0
    out = c(q, k, v, x)
    share = float(out.stats["alpha"])
    assert float(out.aux_loss) == pytest.approx(max(0.0, 1 - 1 / 8 - share) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="target_cr must be >= 1"):
        c.target_cr = 0.5
    schedule = CompressionSchedule(start=1.0, end=8.0, steps=100)
    assert [schedule.value_at(s) for s in (0, 50, 100, 1000)] == [1.0, 4.5, 8.0, 8.0]


def test_decoding_equals_the_eval_forward():
    """A DMS GPT decodes token by token through the engine's cache what its parallel eval forward gives, while
    holding fewer keys than it has seen."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=53, block_size=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                    attention={"name": "dms", "window": 4, "alpha_offset": 0.0})  # fmt: skip
    model = GPT(cfg).double().eval()
    idx = torch.randint(0, 53, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(idx).logits
    seq, cache = policy_logits(model, idx, "dms", sequential=True, prefill_len=9)
    torch.testing.assert_close(seq, ref, rtol=1e-9, atol=1e-9)
    assert bool((cache.kept() < 40).any())


def test_a_tiny_dms_gpt_trains_with_the_schedule(tmp_path):
    """nats-train's build with model/attention=dms and the compression schedule: the loss is finite and falls, the
    schedule's ratio and the evicted share are logged."""
    steps = 20
    run = ["model.block_size=32", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "global_batch_size=4",
           "data.micro_batch_size=4", "optim.lr=1e-2", "optim.warmup_steps=2", f"trainer.max_steps={steps}",
           f"eval_every={steps}", "data.max_eval_windows=4", "final_validation=false", "logger=csv",
           "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false"]  # fmt: skip
    cfg = compose(["model/attention=dms", "callbacks=[dms_schedule]", f"callbacks.dms_schedule.steps={steps}", *run],
                  tmp_path)  # fmt: skip
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == steps
    rows = list(csv.DictReader(open(tmp_path / "csv" / "metrics.csv")))
    loss = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    ratio = [float(r["nats/target_cr"]) for r in rows if r.get("nats/target_cr")]
    evicted = [float(r["train/evicted"]) for r in rows if r.get("train/evicted")]
    assert len(loss) == steps and all(x == x for x in loss)
    assert sum(loss[-3:]) < sum(loss[:3]) - 1.5  # it learns (from ~ln(vocab) = 10.8)
    assert ratio[0] == 1.0 and ratio[-1] > 1.0 and evicted


def test_a_transformers_model_with_dms_decodes_as_its_forward_and_refuses_other_caches():
    """attach_dms: the decisions read the layer's q_proj rows (no parameters of its own); greedy decoding through the
    engine's DMS cache equals the parallel forward's argmax; a DMS cache on a NAtS model (or none on a DMS one), and a
    DMS model decoding without its cache, are refused in one line."""
    transformers = pytest.importorskip("transformers")
    from test_hf_nats import ids, tiny_model

    from nats.hf import StaticPolicyCache, attach_dms, attach_nats, detach_nats
    from nats.hf.compat import cache_kwargs
    from nats.hf.loop import generate

    model = attach_dms(tiny_model("llama").double(), window=4, alpha_offset=0.0).eval()
    assert not [n for n, _ in model.named_parameters() if "nats_scorer" in n]  # it reads q_proj, owns nothing
    prompt = ids(n=30, b=2, seed=3)
    cache = StaticPolicyCache(model, "dms", max_new_tokens=8)
    out = generate(model, prompt, cache, 8, compile=False)
    with torch.no_grad():
        ref = model(out[:, :-1]).logits.argmax(-1)
    assert torch.equal(out[:, 30:], ref[:, 29:])
    assert bool((cache.kept() < out.shape[1] - 1).any())
    with pytest.raises(NotImplementedError, match="decodes through its evicting cache"):
        with torch.no_grad():
            model.generate(
                prompt, max_new_tokens=2, do_sample=False, **cache_kwargs(model, transformers.DynamicCache())
            )
    detach_nats(model)
    attach_nats(model, window=4)
    with pytest.raises(ValueError, match="needs the model's dms attention in every layer .*attach_dms"):
        StaticPolicyCache(model, "dms", max_new_tokens=8)


def test_the_transformers_retrofit_trains_the_query_projections_only(tmp_path):
    """experiment=finetune_smollm2_dms on a tiny Llama, through nats-train's build: only q_proj changes, the
    compression schedule raises the ratio, the run writes dms_q_proj.pt (q_proj's weights alone) and
    dms_stats.json, and the checkpoint holds q_proj alone; loaded after attach_dms, the weights give the trained
    model's logits."""
    transformers = pytest.importorskip("transformers")
    import json

    from test_hf_finetune import overrides

    from nats.hf import attach_dms
    from nats.hf.pretrained import save_tiny_random_llama
    from nats.train import compose_config

    pretrained = save_tiny_random_llama(tmp_path / "tiny")
    out = tmp_path / "run"
    args = [a for a in overrides(pretrained, out, tmp_path / "data") if not a.startswith(("experiment=", "module."))]
    schedule = ["callbacks.dms_schedule.steps=2", "callbacks.dms_schedule.end=4"]
    cfg = compose_config(["experiment=finetune_smollm2_dms", *args, "module.window=16", "trainer.max_steps=4",
                          *schedule, "final_validation=false"])  # fmt: skip
    datamodule, module, trainer = build(cfg)
    before = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    trainer.fit(module, datamodule=datamodule)
    after = module.model.state_dict()
    changed = {k for k, v in after.items() if not torch.equal(v, before[k])}
    assert changed and all(".q_proj." in k for k in changed), sorted(changed)[:4]
    saved = torch.load(out / "dms_q_proj.pt", weights_only=True)
    assert set(saved) == {k for k in after if ".q_proj." in k}
    stats = json.loads((out / "dms_stats.json").read_text())
    assert {"density", "peak", "evicted"} <= set(stats["mean"]) and stats["window"] == 16
    rows = list(csv.DictReader(open(out / "csv" / "metrics.csv")))
    ratios = [float(r["nats/target_cr"]) for r in rows if r.get("nats/target_cr")]
    assert ratios[0] == 1.0 and ratios[-1] == 4.0
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["state_dict"] and all(".q_proj." in k for k in ckpt["state_dict"])
    model = attach_dms(transformers.AutoModelForCausalLM.from_pretrained(pretrained), window=16).eval()
    model.load_state_dict(saved, strict=False)
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    module.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, module.model(ids).logits)


def test_nats_eval_hf_evaluates_a_dms_retrofit(tmp_path):
    """dms=<run>/dms_q_proj.pt: nats-eval-hf attaches DMS with the run's delay and query projections and evaluates
    method dms through its cache (fewer keys kept than the full cache); misuse is one line each."""
    transformers = pytest.importorskip("transformers")
    import json

    from helpers import eval_hf_config
    from nats.finetune import evaluate as E
    from nats.hf import attach_dms
    from nats.hf.pretrained import save_tiny_random_llama

    pretrained = save_tiny_random_llama(tmp_path / "tiny")
    run = tmp_path / "retrofit"
    run.mkdir()
    model = attach_dms(transformers.AutoModelForCausalLM.from_pretrained(pretrained), window=8)
    state = {k: v * 1.5 for k, v in model.state_dict().items() if ".q_proj." in k}  # a "trained" projection
    torch.save(state, run / "dms_q_proj.pt")
    (run / "dms_stats.json").write_text(json.dumps({"window": 8}))
    common = ["data.tasks=[passkey]", "methods=[full,dms]"]
    report = E.run(eval_hf_config(pretrained, tmp_path / "out", f"dms={run}/dms_q_proj.pt", *common))
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["dms"]["kv_fraction"] < rows["full"]["kv_fraction"] == 1
    settings = json.loads((tmp_path / "out" / E.SETTINGS).read_text())
    assert settings["dms"].endswith("dms_q_proj.pt") and settings["window"] == 8
    with pytest.raises(ValueError, match="method 'dms' needs DMS' retrofit: pass dms="):
        E.check_inputs(eval_hf_config(pretrained, tmp_path / "a", *common))
    both = [f"dms={run}/dms_q_proj.pt", f"scorers={run}/dms_q_proj.pt"]
    with pytest.raises(ValueError, match="scorers= and dms= both given"):
        E.check_inputs(eval_hf_config(pretrained, tmp_path / "c", *both, "data.tasks=[passkey]", "methods=[full]"))
    with pytest.raises(FileNotFoundError, match="dms=.* does not exist"):
        E.check_inputs(eval_hf_config(pretrained, tmp_path / "b", "dms=/nowhere/dms_q_proj.pt", *common))


def test_nats_generate_decodes_a_dms_retrofit(tmp_path):
    """nats-generate hf_model=... dms=<file> policy=dms: the retrofit's cache decodes the prompt; policy=dms without
    the file is one line."""
    transformers = pytest.importorskip("transformers")
    import json

    from conftest import compose as compose_cfg
    from nats.generate import generate_report
    from nats.hf import attach_dms
    from nats.hf.pretrained import save_tiny_random_llama

    pretrained = save_tiny_random_llama(tmp_path / "tiny")
    model = attach_dms(transformers.AutoModelForCausalLM.from_pretrained(pretrained), window=8)
    torch.save({k: v for k, v in model.state_dict().items() if ".q_proj." in k}, tmp_path / "dms_q_proj.pt")
    (tmp_path / "dms_stats.json").write_text(json.dumps({"window": 8}))
    base = ["hf_model=smollm2_135m", f"hf_model.name_or_path={pretrained}", "device=cpu", "prompt='Once upon a time'",
            "max_new_tokens=5", "stream=false"]  # fmt: skip
    report = generate_report(compose_cfg([*base, "policy=dms", f"dms={tmp_path}/dms_q_proj.pt"], tmp_path, "generate"))
    assert report["policy"] == "dms" and report["window"] == 8 and len(report["tokens"][0]) == 5
    with pytest.raises(ValueError, match="policy=dms needs DMS' retrofit"):
        generate_report(compose_cfg([*base, "policy=dms"], tmp_path, "generate"))
