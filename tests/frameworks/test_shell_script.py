"""Reading bash launch scripts: variables, quoting, arrays, defaults, arithmetic, command boundaries."""

from __future__ import annotations

import pytest

from memplan.errors import ConfigError
from memplan.frameworks.shell_script import Unresolved, read_script


def test_scalar_variables_export_and_braces_expand() -> None:
    commands = read_script("TP=2\nexport SEQ=4096\npython train.py --tp $TP --seq ${SEQ}\n")
    assert commands == [["python", "train.py", "--tp", "2", "--seq", "4096"]]


def test_unquoted_expansion_splits_quoted_does_not() -> None:
    script = 'GPT_ARGS="--num-layers 24 --hidden-size 1024"\nrun $GPT_ARGS "$GPT_ARGS" \'$GPT_ARGS\'\n'
    assert read_script(script) == [["run", "--num-layers", "24", "--hidden-size", "1024",
                                    "--num-layers 24 --hidden-size 1024", "$GPT_ARGS"]]


def test_defaults_and_assign_defaults() -> None:
    script = "A=\nrun ${MISSING:-7} ${A:-8} ${A-9} ${B:=5} $B ${SET:+x}\n"
    assert read_script(script) == [["run", "7", "8", "5", "5"]]


def test_arrays_with_comments_and_append() -> None:
    script = """declare -a ARGS=(
    --num-layers 2   # layers
    --hidden-size "${H:-64}"
)
ARGS+=(--bf16)
run "${ARGS[@]}" ${ARGS[0]}
"""
    assert read_script(script) == [["run", "--num-layers", "2", "--hidden-size", "64", "--bf16", "--num-layers"]]


def test_arithmetic_continuations_separators_and_redirections() -> None:
    script = "MBS=4\nGBS=$(( MBS * 8 / 2 ))\nrun --gbs $GBS \\\n  --mbs $MBS 2>&1 | tee log; echo done > out && ls\n"
    assert read_script(script) == [["run", "--gbs", "16", "--mbs", "4"], ["tee", "log"], ["echo", "done"], ["ls"]]


def test_unassigned_variables_stay_as_written_and_are_marked() -> None:
    (words,) = read_script('run $X "${Y}" pre$X ${Z[@]} "$@" $1\n')
    assert words == ["run", "$X", "${Y}", "pre$X", "${Z[@]}", "$1"]
    assert [isinstance(w, Unresolved) for w in words] == [False, True, True, False, True, False]


def test_windows_line_endings_and_comments() -> None:
    assert read_script("#!/bin/bash\r\nTP=2 # two\r\nrun --tp $TP\r\n") == [["run", "--tp", "2"]]


@pytest.mark.parametrize("script", ['run "open', "run 'open", "run ${OPEN", "A=(--x 1\n"])
def test_unterminated_quotes_are_config_errors(script: str) -> None:
    with pytest.raises(ConfigError, match="--megatron-args"):
        read_script(script, field="--megatron-args")


def test_command_substitutions_stay_as_written() -> None:
    (words,) = read_script("run --x `date +%s` --y $(hostname -s) --z 2\n")
    assert words == ["run", "--x", "`date +%s`", "--y", "$(hostname -s)", "--z", "2"]
