"""fsagent's link to the controller: the bridge client (``client``), the
controller URL rule and CA trust (``tls``), request ids and request logs
(``requestlog``)."""
