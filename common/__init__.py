"""What fsagent and the controller must agree on. No I/O lives here."""
