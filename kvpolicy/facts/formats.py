"""The KV format registry's facts-stage path: the registry itself is the leaf `kvpolicy.formats`.

Kept so that the importers outside facts (rules, policy analysis, runtime) keep working
until they import the leaf directly; nothing is defined here.
"""

from kvpolicy.formats import FORMATS, FP8_DS_MLA_BYTES, KV_DTYPES, FormatFamily, FormatKind, KvFormat, get_format

__all__ = ["FORMATS", "FP8_DS_MLA_BYTES", "KV_DTYPES", "FormatFamily", "FormatKind", "KvFormat", "get_format"]
