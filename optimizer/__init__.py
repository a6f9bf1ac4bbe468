"""The nightshift core: study (ask/tell), daemon loop, Ray workers, pruning, tracking, export."""
