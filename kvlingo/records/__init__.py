"""What a run writes and reads back: its folders (`paths`), its reports (`report`), its resume keys (`resume`)
and the saved translator (`saved`: folder, evidence, export). It imports the core and nothing above it."""
