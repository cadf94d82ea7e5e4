"""The decision head: the hidden states it reads (at any depth), its training (cross-entropy and RLCD) and its file,
and the head as one of tune's candidates."""
