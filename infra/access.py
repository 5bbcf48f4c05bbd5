"""EndpointAccess: the API key secret hosts follow, and the TLS the stack manages: a certificate authority,
the hosts' server certificate (their internal IPs) in the Secret Manager secret HAProxy's certificate is
fetched from, all readable by the hosts' service account only."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_gcp as gcp
import pulumi_tls as tls

ACCESSOR_ROLE = "roles/secretmanager.secretAccessor"
# The CA outlives many server certificates; a server certificate is replaced by the first `pulumi up`
# within 30 days of its expiry (early_renewal_hours).
CA_HOURS = 10 * 365 * 24
SERVER_HOURS = 365 * 24
RENEW_HOURS = 30 * 24
SERVER_USES = ["digital_signature", "key_encipherment", "server_auth"]


@dataclass
class EndpointAccessArgs:
    project: str
    stack: str
    # spec.serving.api_keys.secret_manager / spec.serving.tls.secret_manager: a NAME this stack creates, or
    # projects/P/secrets/NAME owned elsewhere (then only the accessor binding is made here).
    key_secret: str
    tls_secret: str
    accessor_member: pulumi.Input[str]
    # The hosts' internal IPs: the names their certificate carries (those known so far).
    host_addresses: pulumi.Input[list[str]]
    replication: str | tuple[str, ...] = "automatic"
    labels: dict[str, str] = field(default_factory=dict)


def _replication(replication: str | tuple[str, ...]) -> gcp.secretmanager.SecretReplicationArgs:
    if replication == "automatic":
        return gcp.secretmanager.SecretReplicationArgs(auto=gcp.secretmanager.SecretReplicationAutoArgs())
    return gcp.secretmanager.SecretReplicationArgs(
        user_managed=gcp.secretmanager.SecretReplicationUserManagedArgs(
            replicas=[gcp.secretmanager.SecretReplicationUserManagedReplicaArgs(location=r) for r in replication]
        )
    )


def server_certificate(
    name: str,
    addresses: pulumi.Input[list[str]],
    ca_cert_pem: pulumi.Input[str],
    ca_private_key_pem: pulumi.Input[str],
    opts: pulumi.ResourceOptions,
) -> tuple[tls.PrivateKey, tls.LocallySignedCert]:
    """A server key and certificate for `addresses` (IPs), signed by the stack's CA."""
    key = tls.PrivateKey(f"{name}-key", algorithm="ECDSA", ecdsa_curve="P256", opts=opts)
    request = tls.CertRequest(
        f"{name}-csr",
        private_key_pem=key.private_key_pem,
        subject=tls.CertRequestSubjectArgs(common_name=name, organization="gemmaserve"),
        ip_addresses=addresses,
        dns_names=["localhost"],
        opts=opts,
    )
    cert = tls.LocallySignedCert(
        f"{name}-cert",
        cert_request_pem=request.cert_request_pem,
        ca_cert_pem=ca_cert_pem,
        ca_private_key_pem=ca_private_key_pem,
        validity_period_hours=SERVER_HOURS,
        early_renewal_hours=RENEW_HOURS,
        allowed_uses=SERVER_USES,
        opts=opts,
    )
    return key, cert


class EndpointAccess(pulumi.ComponentResource):
    """Key secret + accessor; CA, host certificate and TLS secret (+ version) + accessor. Exports the CA
    certificate clients trust (public) and the secrets' names, never a key or a private key."""

    def __init__(self, name: str, args: EndpointAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemmaserve:gcp:EndpointAccess", name, None, opts)
        # Children wait for what the component waits for (the project's APIs): Pulumi does not pass depends_on down.
        child = pulumi.ResourceOptions(parent=self, depends_on=opts.depends_on if opts else None)
        self._secrets: dict[str, gcp.secretmanager.Secret] = {}
        # Keys: `gemmaserve keys --stack` adds the versions; Pulumi owns only the secret (no version drifts).
        self.key_secret_name = self._secret(f"{name}-keys", args.key_secret, args, child)[0]

        self.ca_key = tls.PrivateKey(f"{name}-ca-key", algorithm="ECDSA", ecdsa_curve="P256", opts=child)
        self.ca = tls.SelfSignedCert(
            f"{name}-ca",
            private_key_pem=self.ca_key.private_key_pem,
            subject=tls.SelfSignedCertSubjectArgs(common_name=f"gemmaserve {args.stack} CA", organization="gemmaserve"),
            is_ca_certificate=True,
            validity_period_hours=CA_HOURS,
            allowed_uses=["cert_signing", "crl_signing", "digital_signature"],
            opts=child,
        )
        self.ca_cert_pem: pulumi.Output[str] = self.ca.cert_pem
        self.tls_secret_name, owned = self._secret(f"{name}-tls", args.tls_secret, args, child)
        if owned:
            key, cert = server_certificate(
                f"{name}-hosts", args.host_addresses, self.ca.cert_pem, self.ca_key.private_key_pem, child
            )
            # One PEM bundle, the layout HAProxy's `crt` reads: certificate, CA, private key.
            bundle = pulumi.Output.concat(cert.cert_pem, self.ca.cert_pem, key.private_key_pem)
            gcp.secretmanager.SecretVersion(
                f"{name}-tls-version",
                secret=self._secrets[f"{name}-tls"].id,
                secret_data=pulumi.Output.secret(bundle),
                opts=pulumi.ResourceOptions.merge(
                    child, pulumi.ResourceOptions(additional_secret_outputs=["secret_data"])
                ),
            )
        self.register_outputs(
            {"ca_cert": self.ca_cert_pem, "key_secret": self.key_secret_name, "tls_secret": self.tls_secret_name}
        )

    def _secret(
        self, name: str, secret: str, args: EndpointAccessArgs, child: pulumi.ResourceOptions
    ) -> tuple[pulumi.Output[str], bool]:
        """(the secret's resource name, whether this stack owns it); binds the hosts' accessor either way."""
        path = secret.split("/versions/")[0]
        if path.startswith("projects/"):
            secret_name, secret_id, project, owned = (
                pulumi.Output.from_input(path),
                path.split("/")[3],
                path.split("/")[1],
                False,
            )
        else:
            created = gcp.secretmanager.Secret(
                name,
                project=args.project,
                secret_id=path,
                replication=_replication(args.replication),
                labels=args.labels,
                opts=child,
            )
            self._secrets[name] = created
            secret_name, secret_id, project, owned = created.name, created.secret_id, args.project, True
        gcp.secretmanager.SecretIamMember(
            f"{name}-accessor",
            project=project,
            secret_id=secret_id,
            role=ACCESSOR_ROLE,
            member=args.accessor_member,
            opts=child,
        )
        return secret_name, owned
