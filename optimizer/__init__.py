"""The nightshift core: the search policy (`search`, `outcomes`) driven by the daemon loop
(`daemon`) on an executor (`executor`; Ray: `workers`), pruning, records, MLflow tracking,
the report and export. docs/architecture.md draws it."""
