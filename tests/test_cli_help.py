"""What a person sees: every option of every command has a help text, and its default is shown."""
import argparse

import pytest

from qerl.cli import build_parser
from qerl.bench import hf as bench_hf, kernels as bench_kernels, rollout as bench_rollout, step as bench_step


def _commands():
    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    yield from sub.choices.items()
    for name, mod in (("bench kernels", bench_kernels), ("bench rollout", bench_rollout), ("bench step", bench_step),
                      ("bench hf", bench_hf)):
        yield name, mod.build_parser()


COMMANDS = dict(_commands())


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_has_help_and_shows_its_default(name):
    parser = COMMANDS[name]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        flag = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and action.help.strip(), f"qerl {name} {flag}: no help text"
        if action.default not in (None, False) and not action.required and action.option_strings:
            shown = " ".join(str(action.default).split())
            assert f"(default: {shown})" in text, f"qerl {name} {flag}: default {action.default!r} not shown"


def test_help_lists_every_command():
    text = build_parser().format_help()
    for name in COMMANDS:
        if " " not in name:
            assert name in text


def test_cuda_allocator_expandable_segments_by_default_unless_the_user_chose():
    from qerl.cli import ALLOC_CONF, cuda_alloc_defaults

    env = {}
    cuda_alloc_defaults(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF} and "expandable_segments:True" in ALLOC_CONF
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    cuda_alloc_defaults(mine)
    assert mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
