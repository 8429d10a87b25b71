"""`nats-generate`: continue a prompt with a trained model, decoding through any KV-cache policy.

    nats-generate ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt prompt="To be or not to be"
    nats-generate model_dir=models/my-nats policy=nats max_new_tokens=200        # a save_pretrained folder
    nats-generate model_dir=... policy=h2o budget=64 temperature=0.8 top_k=50 seed=1 num_samples=3
    nats-generate --prompt "Once upon a time, in a small village," model_dir=...   # the text as it is
    cat book.txt | nats-generate --prompt - model_dir=...                          # or prompt_file=-

The model is a nats-train checkpoint (``ckpt_path=``) or a folder written by `nats.hub.save_pretrained` /
`nats.hub.export_checkpoint` (``model_dir=``, also a Hugging Face hub id). The prompt: ``--prompt TEXT`` (the text as
it is, commas and quotes included: it never meets Hydra's override grammar, `prompt_arguments`), ``prompt_file=``
(``-``: standard input, as ``--prompt -``) or the override ``prompt=`` (a value in Hydra's grammar: quoted where it
has commas, brackets or quotes); empty: ``<|endoftext|>``. It is tokenised with the GPT-2 tokenizer
(nats.data.tokenizer), prefilled
through the policy's caches (`nats.cache.decode.prefill`), then each new token is one `decode_step`, replayed
as a captured CUDA graph on CUDA (``graph=auto``, the default; eager on the CPU; ``graph=false`` forces eager
decoding): the policy (``policy=``, any registered one that can decode; its options from
``policies.<name>.options``, conf/cache/<name>.yaml) decides which keys and values each layer keeps, with
``budget=`` for the budgeted ones (a token count >= 1, or a fraction in (0, 1) of prompt + new tokens).
Greedy by default (``temperature=0``); ``temperature > 0`` samples, from the ``top_k`` largest logits if set,
with a generator seeded by ``seed``. Token ids beyond the tokenizer's vocabulary (the padding of
``vocab_size=50304``) are never chosen.

Printed (and logged to <run folder>/generate.log; generation.json there holds everything): the text of each
sample, then the cache statistics: KV entries kept per layer and KV head at the end, their fraction of the
tokens processed, the area and peak fractions of the cache over the decode (NATS_SPEC.md section 6), the bytes
kept, and for nats the fractions of global / local / sliding tokens.

The loop is `nats.cache.decode.generate` (``return_caches=True`` keeps the caches for their statistics;
``vocab_limit`` masks the padded vocabulary).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from nats.cache import decode
from nats.cache.budget import resolve_budget
from nats.cache.decode import check_graph, check_model
from nats.cache.engine_cache import EngineCache
from nats.cache.registry import get_cache_class
from nats.checks import check_hf_model, check_local_model
from nats.cli import check_override_syntax, hydra_quoted, hydra_script
from nats.generation_report import summary
from nats.sampling import sampling_options
from nats.utils import atomic_write, resolve_device

log = logging.getLogger(__name__)

__all__ = ["cache_stats", "load", "generate_report", "run", "main", "prompt_arguments"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
_MODEL_HINT = (
    "give ckpt_path=<a nats-train .ckpt> (e.g. logs/train/runs/<run>/checkpoints/last.ckpt) or "
    "model_dir=<a folder written by nats.hub.save_pretrained / export_checkpoint>"
)


# ----------------------------------------------------------------------------------------------------
# decoding
# ----------------------------------------------------------------------------------------------------
def cache_stats(cache: EngineCache) -> dict[str, Any]:
    """What the cache holds after decoding, averaged over layers, KV heads and sequences: `kept` KV entries per
    layer and KV head (and the largest), `kv_fraction` = kept / tokens processed, the `area` and `peak` fractions
    over the decode, `kept_bytes` (keys and values of the kept entries, all layers and sequences) against
    `full_bytes` (what keeping everything would hold), `allocated_bytes`; for nats `type_fractions`."""
    n = cache.t
    kept = cache.kept().to(torch.float64)  # [L, B, Hkv]
    fr = cache.fractions()
    L, B, Hkv = kept.shape
    pool = cache.layers[0].kv_pool
    out = {
        "processed": n,
        "layers": L,
        "kv_heads": Hkv,
        "sequences": B,
        "kept": float(kept.mean()),
        "kept_max": int(kept.max()),
        "kv_fraction": float(kept.mean()) / n,
        "area": float(fr["area"].mean()),
        "peak": float(fr["peak"].mean()),
        "kept_bytes": cache.kept_nbytes(),
        "full_bytes": L * B * Hkv * n * 2 * pool.shape[-1] * pool.element_size(),
        "allocated_bytes": cache.nbytes(),
    }
    if cache.counts_types():
        t = cache.type_fractions().mean(dim=(0, 1, 2))  # [3]
        out["type_fractions"] = dict(zip(("global", "local", "sliding"), (float(v) for v in t)))
    return out


# ----------------------------------------------------------------------------------------------------
# the app
# ----------------------------------------------------------------------------------------------------
def _given(value: Any) -> bool:
    return value is not None and str(value) not in ("", "None", "null")


def load(cfg: DictConfig):
    """The model of `ckpt_path` or `model_dir` (exactly one), on the CPU in float32."""
    from nats.hub import _looks_like_hub_id as looks_like_hub_id
    from nats.hub import from_pretrained, load_checkpoint

    ckpt, folder = cfg.get("ckpt_path"), cfg.get("model_dir")
    if _given(ckpt) and _given(folder):
        raise ValueError(f"give one model, not both ckpt_path={ckpt} and model_dir={folder}")
    if _given(ckpt):
        return load_checkpoint(ckpt)
    if _given(folder):
        if str(folder).endswith(".ckpt"):
            raise ValueError(f"model_dir={folder} is a checkpoint file: pass it as ckpt_path={folder}")
        if Path(str(folder)).exists() or not looks_like_hub_id(str(folder)):
            return from_pretrained(str(folder))  # a folder, or a path that says what is missing
        # a hub id is read from the Hugging Face cache only: nats downloads no model (no network retries offline)
        check_local_model(
            "model_dir",
            str(folder),
            "config.json",
            "point model_dir at a folder written by nats.hub.save_pretrained / export_checkpoint, or pass a "
            "nats-train checkpoint as ckpt_path=<file.ckpt>",
        )
        return from_pretrained(str(folder), local_files_only=True)
    raise ValueError(f"no model given: {_MODEL_HINT}")


def _prompt(cfg: DictConfig) -> str:
    """The text of ``prompt_file`` (``-``: standard input) or of ``prompt``."""
    if _given(cfg.get("prompt_file")):
        stdin = str(cfg.prompt_file) == "-"
        path = Path(str(cfg.prompt_file))
        if not stdin and not path.is_file():
            raise FileNotFoundError(f"prompt_file={path} does not exist")
        if cfg.get("prompt"):
            raise ValueError("give prompt= (or --prompt) or prompt_file=, not both")
        return sys.stdin.read() if stdin else path.read_text(encoding="utf-8")
    return "" if cfg.get("prompt") is None else str(cfg.prompt)


def _policy_options(cfg: DictConfig, policy: str) -> dict[str, Any]:
    pcfg = (cfg.get("policies") or {}).get(policy)
    opts = pcfg.get("options") if pcfg is not None else None
    options = OmegaConf.to_container(opts, resolve=True) if isinstance(opts, DictConfig) else dict(opts or {})
    return {k: v for k, v in options.items() if v is not None}  # null = the policy's default


def _decode_text(enc, tokens: list[int]) -> str:
    """tokens -> text; ids outside the tokenizer's vocabulary as <|id|> (none when vocab_limit applied)."""
    parts, run = [], []
    for t in tokens:
        if 0 <= t < enc.n_vocab:
            run.append(t)
        else:
            parts.append(enc.decode(run))
            parts.append(f"<|{t}|>")
            run = []
    parts.append(enc.decode(run))
    return "".join(parts)


def generate_report(cfg: DictConfig) -> dict[str, Any]:
    """Load, tokenise, decode; returns the texts, tokens and cache statistics (nothing written)."""
    from nats.data.tokenizer import EOT, get_tokenizer

    new = int(cfg.max_new_tokens)
    if new < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {new}")
    samples = int(cfg.get("num_samples", 1))
    if samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {samples}")
    policy = str(cfg.policy)
    cls = get_cache_class(policy)  # an unknown name fails here, with the registered ones
    if cfg.get("precision", "float32") not in DTYPES:
        raise ValueError(f"precision={cfg.precision!r} is not one of {sorted(DTYPES)}")
    device = resolve_device(str(cfg.get("device", "auto")))
    if cfg.get("chat") and cfg.get("hf_model") is None:
        raise ValueError("chat=true needs a transformers chat model: hf_model=<name> (e.g. hf_model=smollm2_135m)")
    if cfg.get("hf_model") is not None:  # a transformers model: model.generate with a (fixed-capacity) policy cache
        check_hf_model(cfg)  # not on this machine: one line with the fix, no network retries
        if cfg.get("chat"):  # a conversation through one cache (nats.hf.chat)
            from nats.hf.chat import chat  # noqa: PLC0415

            return chat(cfg, device, DTYPES[cfg.get("precision", "float32")])
        from nats.hf.generate import generate_hf_report  # noqa: PLC0415

        return generate_hf_report(cfg, _prompt(cfg), device, DTYPES[cfg.get("precision", "float32")])
    enc = get_tokenizer(str(cfg.get("tokenizer", "gpt2")))
    text = _prompt(cfg)
    prompt = enc.encode_ordinary(text) if text else [EOT]
    total = len(prompt) + new
    budget = resolve_budget(cfg.get("budget"), total, of=f"the {total} prompt + new tokens")
    cls.check_use(budget)
    options = _policy_options(cfg, policy)
    if cls.budgeted:  # before the (slow) model load; a budget >= the length keeps everything, as in generate
        cls.rule(**options).check_budget(budget, max(total, (budget or 0) + 1))

    model = load(cfg)
    if model.config.n_out is None and model.config.vocab_size < enc.n_vocab:
        raise ValueError(
            f"the model's vocab_size={model.config.vocab_size} is smaller than the "
            f"{enc.n_vocab} tokens of the {enc.name} tokenizer: it was trained on another vocabulary "
            f"and cannot read this prompt"
        )
    check_model(model)
    cls.check_core(model.config.attention.get("name"))  # before the length checks of decoding
    model = model.to(device=device, dtype=DTYPES[cfg.get("precision", "float32")]).eval()
    sampling = sampling_options(cfg, device)
    graph = cfg.get("graph", "auto")
    check_graph(graph)
    idx = torch.tensor([prompt] * samples, dtype=torch.long, device=device)
    info: dict[str, Any] = {}
    t0 = time.perf_counter()
    tokens, caches = decode.generate(
        model,
        idx,
        new,
        cls,
        budget=budget,
        **sampling,
        vocab_limit=enc.n_vocab,
        graph=graph,
        info=info,
        return_caches=True,
        **options,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    rows = tokens.tolist()
    return {
        "prompt": text,
        "prompt_tokens": len(prompt),
        "new_tokens": new,
        "policy": policy,
        "budget": budget,
        "temperature": float(cfg.temperature),
        "top_k": cfg.get("top_k"),
        "top_p": cfg.get("top_p"),
        "seed": int(cfg.seed),
        "device": str(device),
        "precision": cfg.get("precision", "float32"),
        "decode": info["decode"],
        "texts": [_decode_text(enc, r) for r in rows],
        "continuations": [_decode_text(enc, r[len(prompt) :]) for r in rows],
        "tokens": rows,
        "stats": cache_stats(caches),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(new * samples / seconds, 1) if seconds > 0 else None,
        "model": model.config.to_dict(),
    }


def run(cfg: DictConfig) -> dict[str, Any]:
    """Generate, print the texts and the statistics, write generation.json to ${paths.output_dir}."""
    report = generate_report(cfg)
    if not report.get("chat"):  # a conversation was printed turn by turn
        for i, text in enumerate([] if report.get("streamed") else report["texts"]):  # streamed: printed already
            header = f"--- sample {i}" if len(report["texts"]) > 1 else "---"
            log.info(f"{header}\n{text}")
        log.info("---\n" + summary(report))
    out_dir = cfg.get("paths", {}).get("output_dir") if cfg.get("paths") is not None else None
    if out_dir:
        path = Path(out_dir) / "generation.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(report, indent=2))
        report["output"] = str(path)
    return report


# ----------------------------------------------------------------------------------------------------
# the command line: --prompt TEXT
# ----------------------------------------------------------------------------------------------------
PROMPT_FLAG = "--prompt"
_FREE_TEXT = (
    "give the text as it is with --prompt (e.g. nats-generate --prompt 'Once upon a time, in a village,' ...), "
    "or in a file: prompt_file=<path> (--prompt - or prompt_file=- reads standard input)"
)


def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def prompt_arguments(argv: list[str]) -> list[str]:
    """The command line with ``--prompt TEXT`` (or ``--prompt=TEXT``, anywhere among the overrides) made the override
    ``prompt=<TEXT quoted for Hydra>`` (`nats.cli.hydra_quoted`): the text arrives as it is (commas, quotes,
    brackets, ``${...}``, new lines), never read as Hydra's grammar; ``--prompt -`` is ``prompt_file=-`` (standard
    input). ValueError for ``--prompt`` without its text, given twice or beside ``prompt=`` / ``prompt_file=``, and
    for a ``prompt=`` override Hydra cannot read as one string (commas, quotes), naming ``--prompt``."""
    rest: list[str] = []
    texts: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == PROMPT_FLAG:
            if i + 1 == len(argv):
                raise ValueError(f"{PROMPT_FLAG} needs the text after it: {_FREE_TEXT}")
            texts.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith(PROMPT_FLAG + "="):
            texts.append(arg[len(PROMPT_FLAG) + 1 :])
        else:
            rest.append(arg)
        i += 1
    multirun = [a for a in rest if a in ("-m", "--multirun")]
    for arg in rest:
        if _key(arg) == "prompt" and "=" in arg and check_override_syntax([*multirun, arg]):
            raise ValueError(
                f"Hydra's override grammar cannot read {arg!r} as one string (its commas or quotes): {_FREE_TEXT}"
            )
    if not texts:
        return rest
    if len(texts) > 1:
        raise ValueError(f"{PROMPT_FLAG} is given {len(texts)} times: give the prompt once")
    given = [_key(a) for a in rest if _key(a) in ("prompt", "prompt_file") and not a.startswith("-")]
    if given:
        raise ValueError(f"{PROMPT_FLAG} and {given[0]}= both give the prompt: keep one")
    text = texts[0]
    return ["prompt_file=-" if text == "-" else f"prompt={hydra_quoted(text)}", *rest]


_main = hydra_script("nats-generate", "generate", run, __name__)


def main() -> None:
    """`nats-generate`: ``--prompt TEXT`` taken from the command line (`prompt_arguments`), then the overrides
    checked and the Hydra app (`nats.cli.hydra_script`)."""
    try:
        argv = prompt_arguments(sys.argv[1:])
    except ValueError as err:
        sys.exit(f"nats-generate: {err}")
    sys.argv = [sys.argv[0], *argv]
    _main()


if __name__ == "__main__":
    main()
