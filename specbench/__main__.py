"""`python -m specbench [key=value ...]`: a Hydra sweep over the product of comma lists.

Before Hydra starts, config-group choices are checked (one-line error listing the
choices), `draft_model=<hub id or folder>` is rewritten to `draft_model=hf draft_model.path=<...>`
(`draft=`, its old name, still works and warns), and a method from another package (an entry
point of ``specbench.methods``, or ``method=module:Class``) gets its settings into Hydra's config
store as ``method/<name>``.
"""

from __future__ import annotations

import sys

GROUPS = ("method", "model", "dataset", "draft_model", "logger")


def preprocess(argv: list[str]) -> list[str]:
    from specbench.errors import ConfigError
    from specbench.paths import group_options
    from specbench.run.schema import RENAMED_GROUPS

    from specbench import methods

    known = set(methods.names())
    out = []
    swept = next(([v.strip() for v in a.partition("=")[2].split(",")] for a in reversed(argv)
                  if a.startswith("method=")), None)
    for arg in argv:
        key, eq, val = arg.partition("=")
        head, dot, rest = key.partition(".")
        bare = head.lstrip("+~")
        if bare in RENAMED_GROUPS and (eq or head.startswith("~")):
            print(f"specbench: `{bare}` is now `{RENAMED_GROUPS[bare]}` (the old name goes in the next release)",
                  file=sys.stderr)
            head = head[:len(head) - len(bare)] + RENAMED_GROUPS[bare]
            key = head + dot + rest
            arg = key + eq + val
        if eq and dot and head in known:  # eagle.depth=6 -> method.depth=6
            if swept != [head]:  # would reach the other methods' jobs too
                raise ConfigError(f"{key}= needs method={head} alone (got method={','.join(swept or ['<default>'])}); "
                                  "sweep other methods in a separate command")
            arg = f"method.{rest}={val}"
            key = f"method.{rest}"
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
                raise ConfigError(f"unknown {key} '{bad[0]}'; choices: {', '.join(opts)}{more}")
        out.append(arg)
    return out


def store_outside_methods(argv: list[str]) -> list[str]:
    """Put the settings of every method named in ``argv`` that is not built in (an entry point
    or ``module:Class``) into Hydra's config store as ``method/<name>``; returns their names.
    A class that cannot be imported, or is no proposer, is refused in one line."""
    from hydra.core.config_store import ConfigStore

    from specbench.errors import ConfigError

    from specbench import methods

    names = []
    for arg in argv:
        key, eq, val = arg.partition("=")
        if key == "method" and eq:
            names += [v.strip() for v in val.split(",") if v.strip() not in methods.builtin()]
    for name in dict.fromkeys(names):
        try:
            node = methods.settings(name)
        except KeyError as e:
            raise ConfigError(e.args[0]) from None
        ConfigStore.instance().store(group="method", name=name, node=node)
    return names


def main() -> int:
    from specbench.errors import ConfigError

    try:
        sys.argv[1:] = preprocess(sys.argv[1:])
        store_outside_methods(sys.argv[1:])
    except ConfigError as e:
        print(f"specbench: error: {e}", file=sys.stderr)
        return 2
    import hydra

    from specbench.paths import CONF_DIR
    from specbench.run import runner

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _app(cfg):
        runner.job(cfg)

    _app()
    return 1 if runner.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
