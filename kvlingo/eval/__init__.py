"""Measuring a handoff: reply quality arms, native controls, timing and speed at real shapes, tasks, statistics."""
