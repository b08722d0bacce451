"""Model families: what each transformer family declares for the rest of the stack (``registry``)."""
