"""vLLM's command-line parsing: --flag_name spellings, `--config FILE`, dotted JSON flags, sized integers."""

from __future__ import annotations

import argparse
import json
import re
import sys


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, unless the help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, "", argparse.SUPPRESS, False):
            return text
        return super()._get_help_string(action)


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that takes --flag_name for --flag-name, as vLLM's does, and no abbreviated
    flags (--temp would silently be --temperature, --n ambiguous among --ngram-... flags)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)   # past "--", arguments are values
        try:
            head = _joined_json_args([_dashed(a) for a in _with_config_file(args[:end], self)])
        except (ValueError, argparse.ArgumentTypeError) as e:
            self.error(str(e))
        return super().parse_known_args(head + args[end:], namespace)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """The flags of a parser and of its subcommands' parsers (--config names a subcommand's flags)."""
    flags = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _option_strings(sub)
    return flags


def _with_config_file(args: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's `--config FILE`: a YAML mapping of flag names (dashes or underscores) to values, read as
    flags placed before the others, so that flags given on the command line win. true is the bare flag,
    false a switch's --no- form (else nothing), a list the flag's values, a mapping its JSON."""
    at = next((i for i, a in enumerate(args) if a == "--config" or a.startswith("--config=")), None)
    if at is None:
        return args
    if args[at] == "--config":
        if at + 1 >= len(args):
            raise ValueError("--config needs a YAML file.")
        path, rest = args[at + 1], args[:at] + args[at + 2:]
    else:
        path, rest = args[at].partition("=")[2], args[:at] + args[at + 1:]
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read it as YAML ({e}).") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: must be a YAML mapping of flag names to values.")
    switches = _option_strings(parser)   # (a false value is a switch's --no- form)
    flags: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags += [f"--no-{flag[2:]}"] if f"--no-{flag[2:]}" in switches else []
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    positionals = next((i for i, a in enumerate(rest) if a.startswith("-")), len(rest))   # (subcommand, MODEL)
    return rest[:positionals] + flags + rest[positionals:]


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    if name == "--help":   # vLLM's --help=all / --help=<group>: the help here lists every flag
        return name
    flag, dot, keys = name.partition(".")
    return flag.replace("_", "-") + dot + keys.replace("-", "_") + eq + value


def _joined_json_args(args: list[str]) -> list[str]:
    """vLLM's dotted form of JSON flags: `--speculative-config.num_speculative_tokens 3` (or `=3`) sets that
    key of the flag's JSON object, merged over the object the flag itself gives (values are read as JSON,
    else taken as strings). A ValueError names a dotted flag without a value."""
    heads = [a.partition("=")[0] for a in args if a.startswith("--")]
    dotted = {h.partition(".")[0] for h in heads if "." in h}
    if not dotted:
        return args
    out: list[str] = []
    objects: dict[str, dict] = {}
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        flag, dot, keys = name.partition(".")
        i += 1
        if not (name.startswith("--") and flag in dotted):
            out.append(args[i - 1])
            continue
        if not eq:
            if i >= len(args):
                raise ValueError(f"argument {name}: expected one argument")
            value, i = args[i], i + 1
        if flag not in objects:
            objects[flag] = {}
            out += [flag, ""]   # (its place; filled in below)
        if not dot:   # the whole object, under the dotted keys wherever they stand
            objects[flag] = {**json_object(value), **objects[flag]}
            continue
        node = objects[flag]
        *path, last = keys.split(".")
        for key in path:
            node = node.setdefault(key, {})
        try:
            node[last] = json.loads(value)
        except json.JSONDecodeError:
            node[last] = value
    for flag, obj in objects.items():
        out[out.index(flag) + 1] = json.dumps(obj)
    return out


def human_readable_int(text: str) -> int:
    """vLLM's sizes: an integer, or one with a suffix: k/m/g/t powers of 1000 (decimals allowed, 25.6k),
    K/M/G/T powers of 1024 (whole numbers only)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (an integer, or one with a suffix "
                                             "k/m/g/t x1000 or K/M/G/T x1024)") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (K/M/G/T take whole numbers)")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


def json_object(text: str) -> dict:
    """argparse type of a JSON-object flag: the parser's own message on bad JSON."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value
