"""Re-planning during a run when a device slows down for good: watching each stage's measured
times against the plan (:mod:`.watch`), deciding whether another plan pays for a switch
(:mod:`.decide`), and switching at a drained wave boundary (:mod:`.runner`)."""
