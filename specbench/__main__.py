"""`python -m specbench [key=value ...]`: a Hydra sweep over the product of comma lists.

Before Hydra starts, config-group choices are checked (one-line error listing the
choices), every key is checked against what declares it (a method's settings, the run's schema:
an unknown key is refused in one line, whether set or added with ``+``), `draft_model=<hub id or
folder>` is rewritten to `draft_model=hf draft_model.path=<...>`, and every method's settings
(built in, an entry point of ``specbench.methods``, or ``method=module:Class``) go into Hydra's
config store as ``method/<name>`` (``specbench.methods.store``).
"""

from __future__ import annotations

import functools
import sys

GROUPS = ("method", "model", "dataset", "draft_model", "logger", "accept", "experiment")


def preprocess(argv: list[str]) -> list[str]:
    from specbench.errors import ConfigError, did_you_mean
    from specbench.paths import group_options
    from specbench.run import schema

    from specbench import methods

    known = set(methods.names())
    out = []
    swept = next(([v.strip() for v in a.partition("=")[2].split(",")] for a in reversed(argv)
                  if a.startswith("method=")), None)
    runs = functools.cache(lambda: swept or swept_by_default(argv))  # the methods whose keys method.<key> sets
    for arg in argv:
        key, eq, val = arg.partition("=")
        shown = key.lstrip("+~")  # the key as written, for the messages
        head, dot, rest = key.partition(".")
        bare = head.lstrip("+~")
        sign = head[:len(head) - len(bare)]
        if eq and key == "+experiment":  # the group has a default (none), so Hydra refuses to add it
            presets = group_options("experiment")
            raise ConfigError(f"a preset is experiment=NAME (no +);{did_you_mean(val, presets) or ''} presets: "
                              f"{', '.join(presets)}")
        if eq and not dot and bare in known and bare not in GROUPS:  # pld=3
            raise ConfigError(f"{bare} is a method: method={bare} runs it, {bare}.<key>=... sets its keys "
                              f"({', '.join(k for k in methods.keys(bare) if k != 'name') or 'none'})")
        if (eq or sign) and dot and bare in known:  # eagle.depth=6 -> method.depth=6
            if swept != [bare]:  # would reach the other methods' jobs too
                raise ConfigError(f"{shown}= needs method={bare} alone (got method={','.join(swept or ['<default>'])}); "
                                  "sweep other methods in a separate command")
            key = f"{sign}method.{rest}"
            arg = key + eq + val
        if eq and key in GROUPS:
            opts = methods.names() if key == "method" else group_options(key)
            vals = [v.strip() for v in val.split(",")]
            if key == "draft_model" and any(v not in opts for v in vals):
                if len(vals) > 1:
                    raise ConfigError("draft_model= takes one hub id or folder at a time (or draft names: "
                                      f"{', '.join(opts)})")
                out += ["draft_model=hf", f"draft_model.path={val}"]
                continue
            bad = [v for v in vals if v not in opts and not (key == "method" and methods.is_target(v))]
            if bad:
                more = ", or module:Class (a proposer from your own package)" if key == "method" else ""
                if key == "method" and "." in bad[0] and ":" not in bad[0]:
                    more += f"; a class of your own package is {bad[0]}:<Class>"
                raise ConfigError(f"unknown {key} '{bad[0]}';{did_you_mean(bad[0], opts)} choices: {', '.join(opts)}"
                                  f"{more}")
        if eq and key.lstrip("+") == "dataset.name" and val not in group_options("dataset"):  # HF's name=
            raise ConfigError(f"dataset.name picks the prompt set (dataset={val} is none of "
                              f"{', '.join(group_options('dataset'))}); a hub data set's config is "
                              f"dataset.config={val}")
        if eq or sign.startswith("~"):
            check_key(key.lstrip("+~"), shown, runs)
        plain = key.lstrip("+~")
        if eq and sign == "+" and plain.partition(".")[0] not in (*GROUPS, "hydra") and schema.declared_at(plain):
            raise ConfigError(f"{shown} is a setting already: set it without the + ({plain}={val})")
        values = parsed_values(plain, val) if eq else None
        if values is not None and plain.startswith("method.") and plain.count(".") == 1:
            check_method_value(plain, values, shown, runs())
        elif values is not None and plain not in GROUPS and not plain.startswith(("method.", "hydra.")):
            schema.check_value(plain, values)  # kernel=avx2, bs=0, ctx=abc: refused before the sweep
        out.append(arg)
    return out


def check_key(key: str, shown: str, swept) -> None:
    """Refuse a key that nothing declares: under ``method.``, a key of a method of the sweep
    (``swept()``: their names) that its settings lack; elsewhere one the run's schema lacks.
    Hydra's own keys and a preset's group (``experiment=``, its choice checked above) are Hydra's to check."""
    from specbench.errors import ConfigError, unknown_key
    from specbench.run import schema

    from specbench import methods

    top, _, sub = key.partition(".")
    if top in ("hydra", "experiment") or "/" in key or not key.replace(".", "").replace("_", "").isalnum():
        return
    if top != "method" or not sub:
        schema.check_key(key, shown)
        return
    sub = sub.partition(".")[0]
    try:
        own = {name: methods.keys(name) for name in swept()}
    except KeyError as e:  # an outside class that does not import
        raise ConfigError(e.args[0]) from None
    lack = [name for name, keys in own.items() if sub not in keys]
    has = [name for name, keys in own.items() if sub in keys]
    if lack and has:  # another method's key: it would reach this one's jobs too
        raise ConfigError(f"{shown} is {has[0]}'s, not {lack[0]}'s: set it with method={has[0]} alone and sweep "
                          f"the others in a separate command ({lack[0]}'s keys: "
                          f"{', '.join(k for k in own[lack[0]] if k != 'name') or 'none'})")
    if lack:
        raise unknown_key(shown, own[lack[0]], f"{lack[0]}'s")


def parsed_values(key: str, val: str) -> list | None:
    """The values a command-line ``key=val`` sets, as Hydra parses them (a comma list: each); None
    for a range, a glob, an interpolation or what Hydra cannot parse (Hydra's to expand and say)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    if "${" in val:
        return None
    try:
        parsed = OverridesParser.create().parse_override(f"{key}={val}")
    except Exception:  # noqa: BLE001 - Hydra says what is wrong with its own syntax
        return None
    v = parsed.value()
    if isinstance(v, ChoiceSweep):
        return list(v.list)
    return None if parsed.is_sweep_override() else [v]


def check_method_value(key: str, values: list, shown: str, swept: list[str]) -> None:
    """Refuse, in one line, a value of a method's setting that its type or range does not take
    (``pld.max_ngram=abc``): each of ``values`` held to the settings of each method of the sweep
    that declares the key."""
    from omegaconf import OmegaConf

    from specbench import methods

    field, where = key.partition(".")[2], shown.rpartition(".")[0] + "."
    for name in swept:
        if field in methods.keys(name):
            for one in values:
                methods.check_types(OmegaConf.create({field: one}), name, where)


def swept_by_default(argv: list[str]) -> list[str]:
    """The methods a command line that names none runs: its sweep's (conf/config.yaml's, a preset's,
    or as ``hydra.`` overrides set it), else the config's method; [] where that cannot be told."""
    from hydra import compose, initialize_config_dir

    from specbench.paths import CONF_DIR

    from specbench.run import schema

    own = [a for a in argv if a.startswith("hydra") or a.lstrip("+").startswith("experiment=")]
    try:
        schema.store()
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=own, return_hydra_config=True)
    except Exception:  # noqa: BLE001 - Hydra says what is wrong with its own overrides
        return []
    params = cfg.hydra.sweeper.get("params") or {}
    return [v.strip() for v in str(params.get("method") or cfg.method.name).split(",")]


def store_configs(argv: list[str]) -> None:
    """The run's schema, every registered method's settings and those of each class ``argv`` names
    (``method=module:Class``) into Hydra's config store (``schema.store``). A method named that
    cannot be imported, or is no proposer, is refused in one line."""
    from specbench.errors import ConfigError
    from specbench.run import schema

    named = [v.strip() for a in argv if a.startswith("method=") for v in a.partition("=")[2].split(",")]
    try:
        schema.store(named)
    except KeyError as e:
        raise ConfigError(e.args[0]) from None


def main() -> int:
    from specbench.errors import ConfigError

    try:
        store_configs(sys.argv[1:])
        sys.argv[1:] = preprocess(sys.argv[1:])
    except ConfigError as e:
        print(f"specbench: error: {e}", file=sys.stderr)
        return 2
    import hydra

    from specbench.paths import CONF_DIR
    from specbench.run import runner

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _app(cfg):
        runner.run(cfg)

    _app()
    return 1 if runner.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
