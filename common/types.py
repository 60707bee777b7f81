"""Domain identifiers get their own types so they cannot be mixed up."""

from typing import NewType

FileVersion = NewType("FileVersion", int)
OperationId = NewType("OperationId", str)
LeaseEpoch = NewType("LeaseEpoch", int)
Digest = NewType("Digest", str)
"""Lower-case hex SHA-256 of a file's bytes."""
