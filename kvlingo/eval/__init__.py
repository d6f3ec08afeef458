"""Measuring a handoff: reply quality arms, native controls, item rows, tasks, statistics."""
