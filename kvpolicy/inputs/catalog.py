"""The model and GPU catalogs: YAML data read once, and the names users type resolved.

`resolve_model` takes a catalog id, an alias, a Hugging Face id (all
case-insensitive) or a local config.json path; `resolve_gpu` takes an id, an alias,
an nvidia-smi name (ignoring case, spaces and hyphens), or `auto`, and `gpu_and_count`
also a count (`2xh100`, `h100x2`). Unknown names raise InputError with close matches.
A catalog model is its bundled config.json (`data/configs/<id>.json`) read by
`hfconfig.arch_from_hf_config`, the code that reads a local config, plus the
entry's names; only the requested model's config is parsed.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from kvpolicy import new_list, noun
from kvpolicy.errors import InputError, LimitError
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.datacache import builtin_data
from kvpolicy.inputs.gpus import GpuSpec, detect_gpu_names

DATA_DIR = Path(__file__).parent / "data"
MODELS_PATH = DATA_DIR / "models.yaml"
"""The built-in model catalog."""
GPUS_PATH = DATA_DIR / "gpus.yaml"
"""The built-in GPU catalog."""
CONFIGS_DIR = DATA_DIR / "configs"
"""The catalog models' config.json files."""

_Spec = TypeVar("_Spec", "CatalogEntry", GpuSpec)


class CatalogEntry(BaseModel):
    """A catalog model: the names it answers to and where its config.json is."""

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    id: str
    hf_id: str
    """Hugging Face repository id."""
    aliases: list[str] = Field(default_factory=new_list)
    """Other names accepted on the command line."""
    family: str | None = None
    """Override of the family derived from model_type."""
    config: str | None = None
    """Stem of the config file in data/configs (default: the id)."""
    checkpoint_bytes: int | None = Field(default=None, gt=0)
    """The checkpoint's safetensors total_size, when known."""
    checkpoint_source: str = ""
    """Where `checkpoint_bytes` comes from."""
    source: str = ""
    """Provenance of the config."""

    @property
    def name(self) -> str:
        return self.hf_id


@functools.cache
def load_models(path: Path = MODELS_PATH) -> dict[str, ModelArch]:
    """Every catalog model by id, in file order (parsed once per process; do not mutate)."""
    entries = _catalog(CatalogEntry, path)[0]
    return {key: _model(path, key) for key in entries}


def catalog_ids(path: Path = MODELS_PATH) -> list[str]:
    """Every catalog model id, in file order, without parsing any config."""
    return list(_catalog(CatalogEntry, path)[0])


@functools.cache
def _model(path: Path, key: str) -> ModelArch:
    """One catalog model: its bundled config read by hfconfig, with the entry's names."""
    from kvpolicy.inputs.hfconfig import arch_from_hf_config, read_json

    entry = _catalog(CatalogEntry, path)[0][key]
    folder = path.parent / "configs"
    file = folder / f"{entry.config or key}.json"
    if not file.is_file():
        raise InputError(f"{path}: entry `{key}`: its config {file}: file not found. Add the model's config.json "
                         f"there (and a row in {folder / 'SOURCES.md'}), or set `config:` to the file's stem.")
    config = read_json(file, required=True)
    quant = read_json(folder / f"{entry.config or key}.hf_quant_config.json", required=False)
    checkpoint = None
    if entry.checkpoint_bytes is not None:
        checkpoint = (entry.checkpoint_bytes, f"checkpoint total_size {entry.checkpoint_bytes:,} bytes "
                                              f"({entry.checkpoint_source or 'catalog'})")
    meta = {"hf_id": entry.hf_id, "aliases": list(entry.aliases), "family": entry.family}
    return arch_from_hf_config(config, key, f"catalog {key} ({entry.source or file.name})", hf_quant_config=quant,
                               checkpoint_bytes=checkpoint, meta=meta)


def load_gpus(path: Path = GPUS_PATH) -> dict[str, GpuSpec]:
    """Every catalog GPU by id, in file order (parsed once per process; do not mutate)."""
    return _catalog(GpuSpec, path)[0]


def resolve_model(spec: str, *, where: str = "--model", allow_paths: bool = True) -> ModelArch:
    """A catalog model by id, alias or HF id (case-insensitive), or a local config.json / its folder.

    `allow_paths=False` (the HTTP service) resolves catalog names only and never touches the file system.
    """
    text = spec.strip()
    if not text:
        raise InputError(
            f"{where}: the model name is empty. Name a catalog model (`kvpolicy models` lists them) "
            "or pass the path to a local config.json."
        )
    explicit_path = allow_paths and (text.startswith(("/", "./", "../", "~")) or text.endswith((".json", ".gguf")))
    if not explicit_path:
        index = _catalog(CatalogEntry, MODELS_PATH)[1]
        found = index.get(text.lower())
        if found is not None:
            return _model(MODELS_PATH, found)
    if not allow_paths:
        hint = _suggest(text, _catalog(CatalogEntry, MODELS_PATH)[1])
        raise InputError(f"{where}: unknown model `{text}`.{hint} Name a catalog model (`kvpolicy models` "
                         "lists them); local config.json paths are not accepted here.")
    path = Path(text).expanduser()
    try:
        exists = path.exists()
    except OSError as exc:  # a name too long for the file system, a loop of links
        raise InputError(f"{where}: `{text[:80]}` is not a usable path ({exc.strerror}).") from None
    if exists:
        from kvpolicy.inputs.gguf import gguf_in, load_gguf
        from kvpolicy.inputs.hfconfig import load_hf_config

        gguf = path if path.is_file() and path.suffix.lower() == ".gguf" else gguf_in(path)
        return load_gguf(gguf) if gguf is not None else load_hf_config(path)
    if explicit_path:
        raise InputError(
            f"{where}: `{text}` looks like a path, but no such file or folder exists "
            f"(relative paths start at {Path.cwd()}). Pass an existing config.json or the folder "
            "holding it, or a catalog model name (`kvpolicy models`)."
        )
    hint = _suggest(text, _catalog(CatalogEntry, MODELS_PATH)[1])
    hub = (
        " kvpolicy does not download configs: fetch it (e.g. `huggingface-cli download "
        f"{text} config.json model.safetensors.index.json hf_quant_config.json --local-dir DIR`: files the "
        "repository lacks are skipped; the index gives the exact weight size (without it kvpolicy derives it "
        "from the config's shapes), hf_quant_config.json an older ModelOpt checkpoint's KV-cache quantization) "
        "and pass DIR."
        if "/" in text
        else ""
    )
    raise InputError(
        f"{where}: unknown model `{text}`.{hint} Run `kvpolicy models` to list the catalog, or pass "
        f"the path to a local Hugging Face config.json (or the folder holding it).{hub}"
    )


def resolve_gpu(spec: str, *, where: str = "--gpu") -> GpuSpec:
    """One catalog GPU by id, alias or nvidia-smi name; `auto` detects the local GPU.

    Case, spaces, hyphens, underscores and a leading `NVIDIA`/`AMD` do not count (`RTX 4090`, `rtx-4090`).
    A count (`2xh100`) is refused: the caller has no tensor-parallel size to give it to.
    """
    gpu, count = resolve_gpu_count(spec, where=where)
    if count is not None:
        raise InputError(f"{where}: `{spec.strip()}` names {count} {noun(count, 'GPU')}; name one GPU here, e.g. `{gpu.id}`.")
    return gpu


def gpu_and_count(spec: str, count: int | None, *, where: str = "--gpu",
                  count_where: str = "--tp") -> tuple[GpuSpec, int]:
    """The GPU and how many of them: `2xh100` gives 2 unless `count_where` is given, and must agree with it.

    `count` is None when the user did not set `count_where` (it then defaults to the name's count, else 1).
    """
    gpu, named = resolve_gpu_count(spec, where=where)
    return gpu, agreed_count(spec, gpu, named, count, where=where, count_where=count_where)


def agreed_count(spec: str, gpu: GpuSpec, named: int | None, count: int | None, *, where: str = "--gpu",
                 count_where: str = "--tp") -> int:
    """The GPU count from the count in the name (`named`, from `resolve_gpu_count`) and `count_where`'s value
    (`count`, None when unset): either alone, 1 without both; InputError when both are given and differ."""
    if named is None:
        return 1 if count is None else count
    if count is not None and count != named:
        raise InputError(f"{where} `{spec.strip()}` names {named} {noun(named, 'GPU')} but {count_where} is "
                         f"{count}; give the count once: drop {count_where}, or name the GPU alone (`{gpu.id}`) "
                         f"and keep {count_where} {count}.")
    return named


_COUNTED = (re.compile(r"(?P<n>[0-9]+)\s*[x×*][\s_-]*(?P<name>.*[^\s_-].*)", re.IGNORECASE),
            re.compile(r"(?P<name>.*[^\s_-].*?)[\s_-]*[x×*]\s*(?P<n>[0-9]+)", re.IGNORECASE))
"""`2xh100`, `2x h100`, `2 x H100`; `h100x2`, `h100 x2`, `h100-x2` (also with `×` or `*`)."""
MAX_GPU_COUNT = 1024
"""The largest count accepted in a GPU name, as for --tp."""


def resolve_gpu_count(spec: str, *, where: str = "--gpu") -> tuple[GpuSpec, int | None]:
    """A catalog GPU (see `resolve_gpu`) and the count written with it (`2xh100` -> 2), None when there is none.

    A catalog name always wins over reading it as a count, so no GPU's own name is split.
    """
    text = spec.strip()
    gpus, index = _catalog(GpuSpec, GPUS_PATH)
    if text.lower() == "auto":
        # Mixed machines are rare; the first GPU is the one vLLM uses by default.
        name = detect_gpu_names()[0]
        found = index.get(_gpu_key(name))
        if found is not None:
            return gpus[found], None
        bare = name.removeprefix("NVIDIA ").strip()
        hint = _suggest(_gpu_key(bare), index)
        raise InputError(
            f"{where} auto: nvidia-smi reports `{name}`, which is not in kvpolicy's GPU catalog.{hint} "
            "Name the closest catalog GPU instead, e.g. `--gpu h100` (`kvpolicy gpus` lists them)."
        )
    found = index.get(_gpu_key(text)) if text else None
    if found is not None:
        return gpus[found], None
    parts = []
    for pattern in _COUNTED:
        m = pattern.fullmatch(text)
        if m is None:
            continue
        parts.append(m["name"])
        named = index.get(_gpu_key(m["name"]))
        if named is None:
            continue
        count = int(m["n"])
        if not 1 <= count <= MAX_GPU_COUNT:
            raise LimitError(f"{where}: `{text}` names {count} GPUs; the count must be in 1..{MAX_GPU_COUNT}, "
                             f"e.g. `2x{m['name'].strip()}`.", "gpu")
        return gpus[named], count
    # `2xh1OO`: the close matches of the name part.
    hint = next((h for h in (_suggest(_gpu_key(t), index) for t in [text, *parts] if t) if h), "")
    raise InputError(
        f"{where}: unknown GPU `{text}`.{hint} Run `kvpolicy gpus` to list the catalog, "
        "or use `--gpu auto` to detect the local GPU with nvidia-smi."
    )


def _gpu_key(name: str) -> str:
    """`NVIDIA GeForce RTX 4090` -> `geforcertx4090`, `RTX-4090` -> `rtx4090`: the form GPU names are matched in."""
    key = re.sub(r"[\s_-]+", "", name.lower())
    for vendor in ("nvidia", "amd"):
        if key.startswith(vendor) and len(key) > len(vendor):
            return key[len(vendor):]
    return key


# -- loading ----------------------------------------------------------------------------


_LOOSE = " (GPU names are compared without case, spaces, hyphens, underscores or a leading NVIDIA/AMD)"


@functools.cache
def _catalog(kind: type[_Spec], path: Path) -> tuple[dict[str, _Spec], dict[str, str]]:
    """(entries by id, matching form of each name -> id) for one catalog file; every entry is validated."""
    entries = _read_entries(path)
    items = {key: _validated(kind, key, entry, path) for key, entry in entries.items()}
    index: dict[str, str] = {}
    # GPU names are matched loosely (`RTX 4090` = `rtx-4090`); model names only case-insensitively.
    normal = _gpu_key if kind is GpuSpec else str.lower
    for key, item in items.items():
        for name in _names([item]):
            other = index.setdefault(normal(name), key)
            if other != key:
                raise InputError(
                    f"{path}: entry `{key}`: the name `{name}` also belongs to entry `{other}`"
                    f"{_LOOSE if kind is GpuSpec else ''}. "
                    f"Every id, alias and {'hf_id' if kind is CatalogEntry else 'name'} must be unique; "
                    "remove it from one of them."
                )
    return items, index


def _parse_yaml(text: str, path: Path) -> Any:
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    try:
        return YAML(typ="safe").load(text)
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{at}: malformed YAML ({problem}). Fix the syntax there.") from None


def _read_entries(path: Path) -> dict[str, dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: cannot read the catalog ({exc}). Reinstall kvpolicy or check the path.") from None
    data = builtin_data(path, text, lambda t: _parse_yaml(t, path))
    if not isinstance(data, dict) or not data:
        raise InputError(f"{path}: expected a mapping of catalog ids to entries, found {type(data).__name__}.")
    for key, entry in data.items():
        if not isinstance(key, str) or key != key.lower() or not key.strip():
            raise InputError(f"{path}: catalog id {key!r} must be a non-empty lower-case string; rename it.")
        if not isinstance(entry, dict):
            raise InputError(f"{path}: entry `{key}` must be a mapping of fields, found {type(entry).__name__}.")
    return data


def _validated(kind: type[_Spec], key: str, entry: dict[str, Any], path: Path) -> _Spec:
    from pydantic import ValidationError

    if entry.get("id", key) != key:
        raise InputError(f"{path}: entry `{key}` has `id: {entry['id']}`; drop `id`, the key is the id.")
    try:
        return kind(**{**entry, "id": key})
    except ValidationError as exc:
        problems = []
        for err in exc.errors()[:6]:
            field = ".".join(str(p) for p in err["loc"]) or "(entry)"
            found = err.get("input")
            shown = f" (found {found!r})" if not isinstance(found, dict) and err["type"] != "missing" else ""
            problems.append(f"`{field}`: {err['msg']}{shown}")
        allowed = ", ".join(f for f in kind.model_fields if f != "id")
        raise InputError(
            f"{path}: entry `{key}` is not a valid {kind.__name__}: {'; '.join(problems)}. "
            f"Fix the entry; its fields are: {allowed}."
        ) from None


def _names(items: Any) -> list[str]:
    """Every name an entry answers to: id, aliases, hf_id (models) or nvidia-smi name (GPUs)."""
    out: list[str] = []
    for item in items:
        out.append(item.id)
        out.extend(item.aliases)
        if item.name:
            out.append(item.name)
    return out


def _suggest(text: str, index: dict[str, str]) -> str:
    """' Did you mean `id`, ...?' for entries with a name close to `text` (or to its part after `org/`)."""
    import difflib

    word = text.lower()
    tail = word.rsplit("/", 1)[-1]
    names = list(index)
    close = difflib.get_close_matches(word, names, n=12, cutoff=0.5) or difflib.get_close_matches(
        tail, names, n=12, cutoff=0.5
    )
    if not close and tail:
        # Substring matches catch short names such as `llama` -> every llama entry.
        close = [n for n in names if tail in n]
    ids = list(dict.fromkeys(index[n] for n in close))[:3]
    return (" Did you mean " + ", ".join(f"`{i}`" for i in ids) + "?") if ids else ""
