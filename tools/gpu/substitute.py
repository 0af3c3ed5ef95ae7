"""Write variant trees for the device A/B scripts (tools/gpu/ab.sh, moe_ab.sh).

    python3 tools/gpu/substitute.py VARIANTS_FILE ROOT [NAME ...]
    python3 tools/gpu/substitute.py VARIANTS_FILE --names    (the variants' names, in order)

VARIANTS_FILE has one substitution a line, `NAME | FILE | OLD TEXT | NEW TEXT` (several lines of
one NAME make one variant; `#` lines are comments). Each variant, and each extra NAME (ab.sh's
`base`: the tree unchanged), gets ROOT/v_NAME: a fresh copy of the current directory without
build outputs, then the substitutions. An OLD TEXT that is not in FILE stops with an error
before anything is built.
"""
import shutil
import sys

SKIP = shutil.ignore_patterns("build", ".venv", ".git", ".whl", ".mlxparts", "base.tar")


def lines(variants: str):
    for line in open(variants):
        if not line.lstrip().startswith("#") and "|" in line:
            yield (p.strip() for p in line.rstrip("\n").split("|", 3))


def names(variants: str) -> list[str]:
    return list(dict.fromkeys(name for name, *_ in lines(variants)))


def main(variants: str, root: str, *extra: str) -> None:
    if root == "--names":
        print(" ".join(names(variants)))
        return
    for name in [*extra, *names(variants)]:
        shutil.rmtree(f"{root}/v_{name}", ignore_errors=True)
        shutil.copytree(".", f"{root}/v_{name}", ignore=SKIP, symlinks=True)
    for name, path, old, new in lines(variants):
        f = f"{root}/v_{name}/{path}"
        s = open(f).read()
        if old not in s:
            sys.exit(f"substitute: variant {name}: {old!r} is not in {path}")
        open(f, "w").write(s.replace(old, new))
        print(f"variant {name}: {path}: {old!r} -> {new!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
