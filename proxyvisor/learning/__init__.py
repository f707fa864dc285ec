"""Cross-session learning and recall, sans-IO: memory records and their bounds (:mod:`.memory`), distilling a
finished turn into grounded records (:mod:`.distill`) and the Active Memory Pack recited to the next session
(:mod:`.pack`). The trio shell that reads and writes the memory files is ``proxyvisor.proxy.learning``."""
