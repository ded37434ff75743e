#!/usr/bin/env bash
# Before a device run: record the commit (and whether the tree is dirty) in .commit. The file is
# git-ignored, so name it in the device call's `carry` ([".commit"]); results written there then
# name the code they measured: start the device command with `export PEREGRINE_COMMIT=$(cat .commit)`
# (peregrine.bench.gpu.git_commit prefers it: the device copy's git metadata can be stale).
cd "$(dirname "$0")/.." && echo "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)" > .commit
