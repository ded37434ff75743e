"""Persistent decode (issue #46's second design), the parts that run on the CPU: a decoder layer's task list with
dependencies derived from the regions each task reads and writes (tasks.py), its static per-SM schedule and an
emulator that runs it in any order the dependencies allow (emulator.py), and the table the GPU kernel reads
(table.py: weight pool, tasks, per-CTA lists, counters) with an interpreter of it. The kernel is
kernels/cute/persistent_layer.py (docs/performance.md, "Persistent decode")."""
