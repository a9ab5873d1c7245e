"""The KV format registry's old path, kept for `kvpolicy.kernels` until house-kernels stops importing it.

The registry lives in `kvpolicy.facts.formats`; nothing in kvpolicy outside the kernels imports this module.
"""

from kvpolicy.facts.formats import FORMATS, FP8_DS_MLA_BYTES, KV_DTYPES, FormatKind, KvFormat, get_format

__all__ = ["FORMATS", "FP8_DS_MLA_BYTES", "KV_DTYPES", "FormatKind", "KvFormat", "get_format"]
