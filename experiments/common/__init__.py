"""What several experiments share: where results are written (resultfiles) and torch's oneDNN ISA
cap for CPUs that advertise AMX but may not use it (cpu_isa)."""
