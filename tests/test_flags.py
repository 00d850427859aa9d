"""`dtrain-node --help` as it prints: a boolean flag says what the node does without it, never "(default True)";
a flag with a value shows its default."""
import re

import pytest

from dtrain.flags import SECTIONS, build_parser, markdown_table
from dtrain.node.options import BOOLEAN_ACTIONS, flag_fields, option

pytestmark = pytest.mark.unit

# the boolean flags dtrain-node has now; a new one is checked by the tests below without being named here
KNOWN_BOOLEAN_FLAGS = {"--no-relay", "--no-data", "--no-contributor-scoring", "--no-he", "--feedback-train"}


def printed_help() -> dict[str, str]:
    """Each long flag's entry in `dtrain-node --help`, its wrapped lines joined: "PORT bridge HTTP port (default
    8095)" for --port."""
    entries, current = {}, None
    for line in build_parser().format_help().splitlines():
        start = re.match(r"  (--[a-z0-9-]+)", line)
        if start:
            current = start.group(1)
            entries[current] = line[start.end():]
        elif current and line.startswith("   "):
            entries[current] += " " + line
        else:
            current = None
    return {flag: " ".join(text.split()) for flag, text in entries.items()}


def boolean_fields():
    return [f for _, cls, _ in SECTIONS for f in flag_fields(cls) if f.metadata["argparse"].get("action")
            in BOOLEAN_ACTIONS]


def test_the_known_boolean_flags_are_found():
    assert KNOWN_BOOLEAN_FLAGS <= {f.metadata["flag"] for f in boolean_fields()}
    assert KNOWN_BOOLEAN_FLAGS <= set(printed_help())


@pytest.mark.parametrize("field", boolean_fields(), ids=lambda f: f.metadata["flag"])
def test_boolean_flag_says_what_happens_without_it(field):
    text = printed_help()[field.metadata["flag"]]
    assert "(default" not in text and "True" not in text and "False" not in text, text
    assert re.fullmatch(r".+ \(without it: .{20,}\)", text), text


@pytest.mark.parametrize("field", boolean_fields(), ids=lambda f: f.metadata["flag"])
def test_boolean_flag_turns_its_default_over(field):
    """Without the flag the field keeps its default (what "without it" describes); with it, the other value."""
    action = field.metadata["argparse"]["action"]
    assert field.default is (action == "store_false")
    given = vars(build_parser().parse_args([field.metadata["flag"]]))[field.metadata["argparse"]["dest"]]
    assert given is (not field.default)


def test_no_relay_reads_in_full():
    assert printed_help()["--no-relay"] == (
        "use no libp2p relays (without it: peers may dial this node through a public peer acting as relay, and a "
        "client-mode node looks for one)")


def test_flags_with_a_value_show_their_default():
    text = printed_help()
    assert text["--port"] == "PORT bridge HTTP port (default 8095)"
    assert text["--sync"].endswith("(default low-comm)")
    assert "(default" not in text["--initial-peers"]  # no default value: nothing shown
    assert "without it" not in text["--port"]


def test_the_flag_table_says_off_and_what_happens_without_it():
    rows = {row.split(" | ")[0].strip("| `"): row for row in markdown_table().splitlines()}
    assert rows["--no-data"].startswith("| `--no-data` | off | hand out no /api/v1/data/batch; without it: the node ")
    assert rows["--port"] == "| `--port` | `8095` | bridge HTTP port |"


def test_a_boolean_option_must_say_what_happens_without_it():
    with pytest.raises(TypeError, match="without"):
        option(True, "--no-thing", "do no thing", action="store_false", dest="thing")
    with pytest.raises(TypeError, match="boolean"):
        option(3, "--things", "how many things", without="three")
    field = option(False, "--thing", "do the thing", without="no thing is done", action="store_true")
    assert field.metadata["without"] == "no thing is done"
