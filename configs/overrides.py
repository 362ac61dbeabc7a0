"""The `key=value,...` override strings of the config families (configs/dpo.py, grpo.py, ppo.py)."""


def parse_overrides(arg: str, keys, runs, probes, where: str) -> dict:
    """"a=1,b=2" -> {"a": "1", "b": "2"}; `run=` and `probe=` expand where they stand, later keys win;
    unknown keys, runs and probes are errors naming the config file."""
    out: dict = {}
    for item in (s.strip() for s in (arg or "").split(",")):
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"{where}: override {item!r} is not key=value (keys: {', '.join(keys)})")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in keys:
            raise ValueError(f"{where}: unknown override key {key!r}; keys: {', '.join(keys)}")
        if key == "run":
            if value not in runs:
                raise ValueError(f"{where}: run={value!r}; runs: {', '.join(sorted(runs))}")
            for k, v in runs[value].items():
                if k == "probe":
                    out.update(probes[v])
                out[k] = v
        if key == "probe":
            if value not in probes:
                raise ValueError(f"{where}: probe={value!r}; probes: {', '.join(sorted(probes))}")
            out.update(probes[value])
        out[key] = value
    return out


def choice(key: str, value: str, allowed, where: str) -> str:
    if value not in allowed:
        raise ValueError(f"{where}: {key}={value!r}; choose one of {sorted(allowed)}")
    return value
