"""The user's traffic and latency targets for `kvpolicy plan`, from `key=value` lists or a request."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpolicy.errors import InputError
from kvpolicy.inputs.workload import parse_tokens


class Traffic(BaseModel):
    """Requests the deployment serves: lengths, and a request rate, a concurrency or a burst."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    isl: int = Field(gt=0, le=16_777_216)
    """Input (prompt) tokens per request."""
    osl: int = Field(gt=0, le=16_777_216)
    """Output tokens per request."""
    rate: float | None = Field(default=None, gt=0)
    """Open loop: requests per second arriving (Poisson), over the whole deployment."""
    concurrency: int | None = Field(default=None, gt=0, le=1_000_000)
    """Closed loop: clients, each sending its next request when the last one finishes."""
    burst: int | None = Field(default=None, gt=0, le=1_000_000)
    """Requests that arrive at once: alone, one burst (a benchmark at request rate inf); with `rate`,
    bursts of this size whose mean rate is `rate`."""

    @model_validator(mode="after")
    def _one_load(self) -> Traffic:
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("give either rate= (open loop) or concurrency= (closed loop), not both")
        if self.concurrency is not None and self.burst is not None:
            raise ValueError("burst= goes alone or with rate= (bursts at that mean rate), not with concurrency=")
        if self.rate is None and self.concurrency is None and self.burst is None:
            raise ValueError("give the load: rate=2/s, concurrency=64 or burst=100")
        return self

    @property
    def context_tokens(self) -> int:
        """Tokens one request holds at its end: the max_model_len the plan sizes the cache for."""
        return self.isl + self.osl

    def describe(self) -> str:
        load = (f"concurrency {self.concurrency}" if self.concurrency is not None else
                f"rate {self.rate:g}/s" + (f" in bursts of {self.burst}" if self.burst else "") if self.rate
                else f"one burst of {self.burst}")
        return f"isl {self.isl:,}, osl {self.osl:,}, {load}"


class Slo(BaseModel):
    """Latency targets; a missing one is not checked."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    ttft_s: float | None = Field(default=None, gt=0)
    """Mean time to first token, seconds."""
    tpot_ms: float | None = Field(default=None, gt=0)
    """Mean time per output token after the first, milliseconds."""

    def describe(self) -> str:
        parts = ([f"TTFT <= {self.ttft_s:g} s"] if self.ttft_s is not None else []) + \
                ([f"TPOT <= {self.tpot_ms:g} ms"] if self.tpot_ms is not None else [])
        return ", ".join(parts) or "none"


_PAIR = re.compile(r"^\s*([a-z_]+)\s*=\s*(.+?)\s*$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(ms|s|us)?$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*(?:/\s*(s|min|m|h))?$")


def _pairs(text: str, flag: str, keys: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        m = _PAIR.match(part.lower())
        if not m or m.group(1) not in keys:
            raise InputError(f"{flag}: `{part.strip()}` is not one of {', '.join(k + '=...' for k in keys)} "
                             f"(e.g. {flag} {_EXAMPLE[flag]}).")
        if m.group(1) in out:
            raise InputError(f"{flag}: `{m.group(1)}` is given twice.")
        out[m.group(1)] = m.group(2)
    return out


_EXAMPLE = {"--traffic": "isl=20k,osl=1k,rate=2/s", "--slo": "ttft=2s,tpot=40ms"}


def parse_duration(text: str, what: str, *, unit: str) -> float:
    """`2s`, `1500ms`, `0.5` (in `unit`) -> a number in `unit` (s or ms)."""
    m = _DURATION.match(text.strip().lower())
    if not m:
        raise InputError(f"{what}: `{text}` is not a duration; write 2s, 1500ms or 40ms.")
    value = float(m.group(1))
    given = m.group(2) or unit
    seconds = value * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[given]
    result = seconds if unit == "s" else seconds * 1e3
    if result <= 0:
        raise InputError(f"{what}: must be positive, found `{text}`.")
    return result


def parse_rate(text: str, what: str) -> float:
    """`2/s`, `120/min`, `2` -> requests per second."""
    m = _RATE.match(text.strip().lower())
    if not m:
        raise InputError(f"{what}: `{text}` is not a rate; write 2/s, 120/min or 7200/h.")
    per = {"s": 1.0, None: 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}[m.group(2)]
    value = float(m.group(1)) / per
    if value <= 0:
        raise InputError(f"{what}: must be positive, found `{text}`.")
    return value


def _count(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InputError(f"{what}: expects a whole number, found `{text}`.") from None
    if value <= 0:
        raise InputError(f"{what}: must be positive, found {value}.")
    return value


def parse_traffic(text: str) -> Traffic:
    """`isl=20k,osl=1k,rate=2/s` | `...,concurrency=64` | `...,burst=100` -> Traffic."""
    kv = _pairs(text, "--traffic", ("isl", "osl", "rate", "concurrency", "burst"))
    missing = [k for k in ("isl", "osl") if k not in kv]
    if missing:
        raise InputError(f"--traffic: missing {' and '.join(k + '=' for k in missing)} (e.g. --traffic "
                         f"{_EXAMPLE['--traffic']}).")
    fields = {
        "isl": parse_tokens(kv["isl"], "--traffic isl"),
        "osl": parse_tokens(kv["osl"], "--traffic osl"),
        "rate": parse_rate(kv["rate"], "--traffic rate") if "rate" in kv else None,
        "concurrency": _count(kv["concurrency"], "--traffic concurrency") if "concurrency" in kv else None,
        "burst": _count(kv["burst"], "--traffic burst") if "burst" in kv else None,
    }
    return make_traffic(fields, "--traffic")


def make_traffic(fields: dict[str, object], where: str) -> Traffic:
    """Validate traffic fields; errors name `where`."""
    from pydantic import ValidationError

    try:
        return Traffic.model_validate(fields)
    except ValidationError as exc:
        raise InputError(f"{where}: " + "; ".join(_message(e) for e in exc.errors()) + ".") from None


def parse_slo(text: str) -> Slo:
    """`ttft=2s,tpot=40ms` -> Slo."""
    kv = _pairs(text, "--slo", ("ttft", "tpot"))
    return Slo(ttft_s=parse_duration(kv["ttft"], "--slo ttft", unit="s") if "ttft" in kv else None,
               tpot_ms=parse_duration(kv["tpot"], "--slo tpot", unit="ms") if "tpot" in kv else None)


def _message(err: dict) -> str:
    loc = ".".join(str(x) for x in err.get("loc", ()))
    msg = str(err.get("msg", "")).removeprefix("Value error, ")
    return f"{loc} {msg}".strip() if loc else msg
