"""Persistent decode (issue #46's second design), the parts that run on the CPU: a decoder layer's task list with
dependencies derived from the regions each task reads and writes (tasks.py), its static per-SM schedule and an
emulator that runs it in any order the dependencies allow (emulator.py). The kernel that would run the schedule on
the GPU is not written yet (docs/performance.md, "Persistent decode")."""
