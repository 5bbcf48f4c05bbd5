"""The sandbox's NAT ruleset lets hosts reach the bucket emulator's one address and port, nothing more."""

from __future__ import annotations

import re
import subprocess

from gemmaserve.sandbox import bucket
from gemmaserve.sandbox.network import nat_ruleset


def test_input_chain_admits_only_the_bucket_port_before_dropping():
    ruleset = nat_ruleset("eth0", ["192.0.2.53"])
    chain = ruleset.split("chain input {")[1].split("}")[0]
    accept = f'iifname "gs-sb*" ip daddr {bucket.ADDRESS} tcp dport {bucket.PORT} accept'
    assert accept in chain
    assert chain.index(accept) < chain.index('iifname "gs-sb*" drop')
    assert len(re.findall(r"dport \d+ accept", chain)) == 1


def test_ruleset_is_valid_nftables():
    """nft's own parser in check mode (nothing applied); nft comes with .ci/system-packages."""
    check = subprocess.run(
        ["nft", "-c", "-f", "-"], input=nat_ruleset("eth0", ["192.0.2.53"]), text=True, capture_output=True
    )
    assert check.returncode == 0, check.stderr
