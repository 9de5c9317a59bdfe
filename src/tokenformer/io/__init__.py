"""Files and processes: atomic writes, untrusted torch loads, checkpoint and output folders, the
run lock, the process group, progress bars. The bottom layer: imports nothing else of the package
(docs/architecture.md)."""
