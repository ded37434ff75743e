#!/usr/bin/env bash
# Before a device run: record the commit (and whether the tree is dirty) in .commit, which travels
# with the working tree, so results written there name the code they measured.
cd "$(dirname "$0")/.." && echo "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)" > .commit
