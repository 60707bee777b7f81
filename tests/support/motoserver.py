"""moto's S3 server (``python motoserver.py -H HOST -p PORT``) with one fix:
ListMultipartUploads reports when each upload was initiated.

moto answers every upload's ``Initiated`` with one fixed date in 2010, so a
controller that ages incomplete uploads (GC's sweep of abandoned ones) would
take every upload, a live one too, for stale. Real S3 and the S3-protocol
servers operators run report the time of ``CreateMultipartUpload``; so does
this server.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import Any

from moto.core.common_types import TYPE_RESPONSE
from moto.s3 import models, responses
from moto.server import main

_initiated: dict[str, datetime] = {}
_create = models.FakeMultipart.__init__
_list = responses.S3Response.list_multipart_uploads


def _init(self: models.FakeMultipart, *args: Any, **kwargs: Any) -> None:
    _create(self, *args, **kwargs)
    _initiated[self.id] = datetime.now(UTC)


def _list_multipart_uploads(self: responses.S3Response) -> TYPE_RESPONSE:
    serialized = self.serialized

    def with_times(result: Any) -> TYPE_RESPONSE:
        for upload in result.result["Uploads"]:
            upload["Initiated"] = _initiated.get(upload["UploadId"], upload["Initiated"])
        return serialized(result)

    self.serialized = with_times  # type: ignore[method-assign]
    try:
        return _list(self)
    finally:
        del self.serialized


models.FakeMultipart.__init__ = _init  # type: ignore[method-assign]
responses.S3Response.list_multipart_uploads = _list_multipart_uploads  # type: ignore[method-assign]

if __name__ == "__main__":
    main(sys.argv[1:])
