"""The Python client against a node with TLS and a token file (docs/security.md): the TLS
options, bearer tokens, tenants and the errors a caller gets without them."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import unittest

import kvmesh
from kvmesh import Attention, CacheSpec, DType, TlsOptions

import nodes

TENANT_TOKEN = "py-test-team-a-token"
ADMIN_TOKEN = "py-test-ops-token"


def make_certificates(directory: str) -> None:
    """A CA and a node certificate for py-tls / 127.0.0.1 (serverAuth and clientAuth), as
    docs/security.md makes them."""
    config = os.path.join(directory, "ext.cnf")
    with open(config, "w") as f:
        f.write("[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = unused\n"
                "[ca_ext]\nbasicConstraints = critical,CA:TRUE\n"
                "keyUsage = critical,keyCertSign,cRLSign\n"
                "[node_ext]\nbasicConstraints = critical,CA:FALSE\n"
                "keyUsage = critical,digitalSignature,keyEncipherment\n"
                "extendedKeyUsage = serverAuth,clientAuth\n"
                "subjectAltName = DNS:py-tls,IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", "-new", "-config", config, "-extensions", "ca_ext", *ec,
            "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=py test CA")
    openssl("req", "-new", "-config", config, *ec, "-keyout", "node.key", "-out", "node.csr",
            "-subj", "/CN=py-tls")
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "node.crt", "-days", "2", "-extfile", config,
            "-extensions", "node_ext")


@unittest.skipUnless(shutil.which("openssl"), "needs the openssl command")
class SecurityTest(nodes.NodeTestCase):

    @classmethod
    def setUpClass(cls) -> None:
        cls.dir = tempfile.mkdtemp(prefix="kvmesh-py-tls-")
        make_certificates(cls.dir)
        tokens = os.path.join(cls.dir, "tokens")
        with open(tokens, "w") as f:
            for token, tenant, role in ((TENANT_TOKEN, "team-a", "tenant"),
                                        (ADMIN_TOKEN, "ops", "admin")):
                digest = hashlib.sha256(token.encode()).hexdigest()
                f.write(f"token sha256:{digest} {tenant} {role}\n")
        path = lambda name: os.path.join(cls.dir, name)  # noqa: E731
        cls.node = nodes.Node("py-tls", args=[
            f"--tls-cert={path('node.crt')}", f"--tls-key={path('node.key')}",
            f"--peer-ca={path('ca.crt')}", f"--token-file={tokens}"])
        cls.tls = TlsOptions(ca_file=path("ca.crt"))

    @classmethod
    def tearDownClass(cls) -> None:
        try:
            cls.node.stop_checked()
        finally:
            shutil.rmtree(cls.dir, ignore_errors=True)

    def client(self, **kwargs: object) -> kvmesh.Client:
        kwargs.setdefault("tls", self.tls)
        client = kvmesh.Client(self.node.address, timeout=10, **kwargs)  # type: ignore[arg-type]
        self.addCleanup(client.close)
        return client

    def test_tenants_and_tokens(self) -> None:
        team = self.client(token=TENANT_TOKEN)
        spec = CacheSpec("py-secret", DType.F16, 1, 16, 8, [Attention(1, 1, 4)])
        info = team.create_cache(spec).cache
        self.addCleanup(team.delete_cache, spec.name)
        self.assertEqual(info.tenant, "team-a")
        team.append(spec.name, [(0, 0)], team.layout(spec.name).zeros(1))
        # An admin acting for team-a sees its cache; on its own tenant it does not exist.
        admin_for_team = self.client(token=ADMIN_TOKEN, tenant="team-a")
        self.assertEqual(admin_for_team.read(spec.name, 0).positions, ((0,),))
        with self.assertRaisesRegex(kvmesh.NotFound, "py-secret"):
            self.client(token=ADMIN_TOKEN).get_cache(spec.name)
        # A tenant may not act for another, nor drain.
        with self.assertRaises(kvmesh.PermissionDenied):
            self.client(token=TENANT_TOKEN, tenant="ops").list_caches()
        with self.assertRaises(kvmesh.PermissionDenied):
            team.drain(resume=True)

    def test_errors_without_credentials(self) -> None:
        with self.assertRaises(kvmesh.Unauthenticated) as e:
            self.client().list_caches()
        self.assertNotIn(TENANT_TOKEN, str(e.exception))
        with self.assertRaises(kvmesh.Unauthenticated):
            self.client(token="not-a-token-of-the-file").list_caches()
        with self.assertRaises(kvmesh.Unavailable):
            self.client(tls=None, token=TENANT_TOKEN).list_caches()
        with self.assertRaisesRegex(ValueError, "bearer token has a space") as v:
            self.client(token="two words")
        self.assertNotIn("two words", str(v.exception))

    def test_server_name(self) -> None:
        named = self.client(tls=TlsOptions(ca_file=self.tls.ca_file, server_name="py-tls"),
                            token=TENANT_TOKEN)
        self.assertEqual(named.list_members()[0].name, "py-tls")
        wrong = self.client(tls=TlsOptions(ca_file=self.tls.ca_file, server_name="mallory"),
                            token=TENANT_TOKEN)
        with self.assertRaises(kvmesh.Unavailable):
            wrong.list_caches()


if __name__ == "__main__":
    unittest.main()
