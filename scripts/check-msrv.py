#!/usr/bin/env python3
"""Checks that the `rust-version` the workspace states is its true minimum.

Reads `cargo metadata` (no network: run after a build has fetched the crates), walks the
normal and build dependencies of every workspace member, and fails when one of them needs a
newer Rust than the member states, or when the member states a version newer than both what its
dependencies need and what its own code needs (`CODE_NEEDS`: edition 2024 let chains, 1.88;
trait upcasting to `dyn Any`, 1.86). The toolchain here is the only one this machine has, so a
build with an older compiler cannot be tried: this is the check instead.
"""
import json
import subprocess
import sys

# What the code itself needs, whatever the dependencies: let chains in edition 2024.
CODE_NEEDS = (1, 88)


def ver(text):
    return tuple(int(x) for x in text.split("."))[:2]


def main():
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--locked"]
            if "--locked" in sys.argv
            else ["cargo", "metadata", "--format-version", "1"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    packages = {p["id"]: p for p in meta["packages"]}
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    failed = False
    for member in meta["workspace_members"]:
        pkg = packages[member]
        stated = pkg.get("rust_version")
        if not stated:
            print(f"{pkg['name']}: no rust-version stated")
            failed = True
            continue
        # Normal and build dependencies, transitively (dev-dependencies do not bind users).
        seen, stack, need, who = set(), [member], CODE_NEEDS, "its own code"
        while stack:
            node = nodes[stack.pop()]
            for dep in node["deps"]:
                kinds = {k["kind"] for k in dep["dep_kinds"]}
                if not (kinds & {None, "build"}) or dep["pkg"] in seen:
                    continue
                seen.add(dep["pkg"])
                stack.append(dep["pkg"])
                rv = packages[dep["pkg"]].get("rust_version")
                if rv and ver(rv) > need:
                    need = ver(rv)
                    who = f"{packages[dep['pkg']]['name']} {packages[dep['pkg']]['version']}"
        need_text = ".".join(map(str, need))
        if ver(stated) < need:
            print(f"{pkg['name']}: states rust-version {stated}, but {who} needs {need_text}")
            failed = True
        elif ver(stated) > need:
            print(f"{pkg['name']}: states rust-version {stated}, but the true minimum is {need_text} ({who})")
            failed = True
        else:
            print(f"{pkg['name']}: rust-version {stated} is the true minimum ({who})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
