"""pyinfra inventory of the local sandbox hosts, read from `gemmaserve sandbox`'s state."""

from gemmaserve.sandbox.credentials import API_KEY as _API_KEY_FILE
from gemmaserve.sandbox.credentials import ensure as _credentials
from gemmaserve.sandbox.profile import sandbox_host_data
from gemmaserve.sandbox.state import load_state

# Run `gemmaserve sandbox up` first; with no hosts up this group is empty.
sandbox = [
    (
        _host.name,
        {
            **_host.ssh_data(),
            "gemmaserve_sandbox": True,
            "gemmaserve_sandbox_index": _host.index,
            # Its certificate (signed by the sandbox's CA) and the digest of the sandbox's API key.
            "access_tls_src": str(_credentials(_host).tls_bundle),
            "access_api_keys_src": str(_credentials(_host).key_store),
            # What a client of the host uses when the operator names no key (status, verify, bench).
            "gemmaserve_client_credentials": {
                "ca_cert": str(_credentials(_host).ca_cert),
                "api_key_file": str(_API_KEY_FILE),
            },
            **sandbox_host_data(_host.host_data),
        },
    )
    for _host in load_state().hosts
]
