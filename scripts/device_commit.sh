#!/usr/bin/env bash
# Before a device run: record the commit (and whether the tree is dirty) in .commit. The file is
# git-ignored, so name it in the device call's `carry` ([".commit"]); results written there then
# name the code they measured (peregrine.bench.gpu.git_commit reads it when git has no history).
cd "$(dirname "$0")/.." && echo "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)" > .commit
