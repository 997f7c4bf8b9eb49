"""Property-based tests (hypothesis) of what reads user input: a setting, a data row and the
credential rules. Whatever arrives, the answer is a result or the project's own error naming
what is wrong, never another exception and never a credential's value. Profiles:
tests/conftest.py (derandomised in the suite; HYPOTHESIS_PROFILE=thorough for a long search)."""

import re
import string

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from rlhf_core.common.errors import BadRow
from rlhf_core.config.credentials import _dotted_keys, holds_credential, holds_key
from rlhf_core.config.data_settings import QueryFormat
from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import ConfigError, PipelineConfig
from rlhf_core.data.rows import normalise_row
from rlhf_core.data.trl import normalise_trl_row

ALNUM = string.ascii_letters + string.digits
KNOWN_KEYS = _dotted_keys(PipelineConfig)
NAME = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True)
#: dotted keys: known ones, known ones with a part added or changed, and made-up ones
KEYS = st.one_of(
    st.sampled_from(KNOWN_KEYS),
    st.tuples(st.sampled_from(KNOWN_KEYS), NAME).map(".".join),
    st.tuples(st.sampled_from(KNOWN_KEYS), NAME).map(lambda t: t[0].rpartition(".")[0] + "." + t[1]),
    st.lists(NAME, min_size=1, max_size=4).map(".".join),
)
#: YAML-ish values: scalars, flow collections, broken YAML and free text
VALUES = st.one_of(
    st.sampled_from(["0", "-1", "1e-3", "true", "null", "~", "[]", "{}", "[1, 2", "{a: [", "a: b: c", "'x", "- x"]),
    st.integers(-(10**12), 10**12).map(str),
    st.floats(allow_nan=True).map(str),
    st.text(string.printable, max_size=30),
)
KEY_SHAPES = st.one_of(
    st.text(ALNUM + "-_", min_size=30, max_size=60).map(lambda s: "sk-ant-api03-" + s),
    st.text(string.ascii_uppercase + string.digits, min_size=16, max_size=16).map(lambda s: "AKIA" + s),
    st.text(ALNUM, min_size=36, max_size=40).map(lambda s: "ghp_" + s),
    st.text(string.ascii_lowercase, min_size=15, max_size=20).map(lambda s: "hf_" + s + s.upper()),
)


def _names_a_key(message: str, key: str) -> bool:
    return key.split(".")[0] in message or re.search(r"\b[a-z_]+\.[a-z_]+", message) is not None


@pytest.mark.heavy
@given(key=KEYS, value=VALUES)
def test_an_override_gives_a_configuration_or_a_config_error_naming_a_key(key, value):
    try:
        cfg = load_config("smoke", [f"{key}={value}"])
    except ConfigError as exc:
        assert _names_a_key(str(exc), key), str(exc)
    else:
        assert isinstance(cfg, PipelineConfig)


@given(key=KEYS, secret=KEY_SHAPES, wrap=st.sampled_from(["{}", "[{}]", "{{a: {}}}", "x{}", "{}: [", "'{}"]))
def test_a_credential_shaped_value_is_refused_and_never_shown(key, secret, wrap):
    value = wrap.format(secret)
    try:
        load_config("smoke", [f"{key}={value}"])
    except ConfigError as exc:
        assert secret not in str(exc), str(exc)
    else:  # only where the key shape does not stand alone (x<key>): no credential there
        assert not holds_key(value)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
TLDR_FIELDS = ["id", "subreddit", "title", "post", "site", "summary", "chosen", "rejected", "chosen_policy"]
TLDR_FIELDS += ["rejected_policy", "batch", "split", "confidence", "worker", "orig_split"]
HUB_FIELDS = ["info", "summaries", "choice", "extra", "batch", "split", "worker"]
TRL_FIELDS = ["prompt", "completion", "messages", "chosen", "rejected", "id"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", 3]), "content": JSON})


def _rows(fields: list[str]) -> st.SearchStrategy:
    """JSON values, and objects holding some of ``fields`` (so that the checks past the first run)."""
    text_or_json = st.one_of(st.text(max_size=20), JSON, st.lists(MESSAGE, max_size=3))
    return st.one_of(JSON, st.dictionaries(st.sampled_from(fields), text_or_json, max_size=len(fields)))


#: the hub's comparison form (openai/summarize_from_feedback): info, two summaries, a choice
HUB_ROWS = st.fixed_dictionaries(
    {
        "summaries": st.lists(st.dictionaries(st.sampled_from(["text", "policy"]), JSON), min_size=2, max_size=2),
        "choice": st.sampled_from([0, 1]) | JSON,
        "info": JSON | st.dictionaries(st.sampled_from(TLDR_FIELDS + ["article"]), JSON),
    },
    optional={"extra": JSON | st.fixed_dictionaries({"confidence": JSON}), "batch": JSON},
)


@given(rec=_rows(TLDR_FIELDS + HUB_FIELDS) | HUB_ROWS, kind=st.sampled_from(["sft", "preference"]))
def test_a_tldr_row_is_normalised_or_a_bad_row_with_its_reason(rec, kind):
    try:
        row = normalise_row(rec, kind, QueryFormat())
    except BadRow as exc:
        assert re.fullmatch(r"[a-z_]+(:[a-z_]+)?", exc.reason), exc.reason
    else:
        assert isinstance(row, dict) and all(isinstance(row[f], str) for f in ("post", "title"))


@given(rec=_rows(TRL_FIELDS), kind=st.sampled_from(["sft", "preference"]))
def test_a_trl_row_is_normalised_or_a_bad_row_with_its_reason(rec, kind):
    try:
        form, row = normalise_trl_row(rec, kind, {})
    except BadRow as exc:
        assert re.fullmatch(r"[a-z_]+(:[a-z_]+)?", exc.reason), exc.reason
    else:
        assert form in ("standard", "conversational") and isinstance(row, dict)


HUB_IDS = st.from_regex(r"[A-Za-z][A-Za-z0-9\-]{0,20}/[A-Za-z][A-Za-z0-9.\-]{0,30}", fullmatch=True)
PATHS = st.lists(st.from_regex(r"[a-z0-9_\-]{1,12}", fullmatch=True), min_size=1, max_size=5).map(
    lambda parts: "/" + "/".join(parts)
)


@given(source=st.one_of(HUB_IDS, PATHS, PATHS.map(lambda p: "." + p), HUB_IDS.map(lambda h: "pkg:" + h)))
def test_hub_ids_and_paths_are_settings(source):
    assume(not any(re.search(r"[A-Za-z0-9]{20,}", part) for part in re.split(r"[/.\-]", source)))
    for name in ("base", "tokenizer", "api_key_secret", "token"):
        assert not holds_credential(source, name), (name, source)


@given(secret=KEY_SHAPES, name=st.sampled_from(["base", "judge_model", "revision", "api_key", "x"]))
def test_keys_of_each_known_shape_are_refused(secret, name):
    assert holds_key(secret) and holds_credential(secret, name)
