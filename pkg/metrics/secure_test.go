package metrics_test

import (
	"context"
	"crypto/tls"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	certutil "k8s.io/client-go/util/cert"
	"sigs.k8s.io/yaml"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/metrics"
)

// The agent's service account and namespace, which deploy/rbac/metrics binds.
const agentNamespace, agentAccount = "kube-system", "ip-masq-agent"

// TestProtectAgainstAnAPIServer: /metrics behind Protect, over TLS with a self-signed certificate,
// against a real API server with its service-account token authenticator and RBAC, the agent
// holding only the permissions deploy/rbac/metrics grants it: no token and a token the API server
// did not issue are refused with 401, a service account without the reader role with 403, and
// one bound to deploy/rbac/metrics' reader role is served.
func TestProtectAgainstAnAPIServer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cp := cluster.StartControlPlane(t, cluster.Options{})
	applyRBAC(ctx, t, cp, "clusterrole.yaml", "reader.yaml")
	cfg := rest.AnonymousClientConfig(cp.Config)
	cfg.BearerToken = serviceAccountToken(ctx, t, cp, agentNamespace, agentAccount)

	const body = "# metrics\n"
	h, err := metrics.Protect(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, body) }), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET "+metrics.Path, h)
	srv := httptest.NewUnstartedServer(mux)
	if srv.TLS, err = metrics.TLSConfig("", ""); err != nil {
		t.Fatal(err)
	}
	srv.StartTLS()
	defer srv.Close()
	// As Prometheus scrapes a self-signed endpoint (insecure_skip_verify).
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	scrape := func(token string) (int, string) {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+metrics.Path, nil)
		if err != nil {
			t.Fatal(err)
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}

	const readerAccount, strangerAccount = "prometheus", "stranger"
	reader := serviceAccountToken(ctx, t, cp, "default", readerAccount)
	stranger := serviceAccountToken(ctx, t, cp, "default", strangerAccount)
	bind(ctx, t, cp, "ip-masq-agent-metrics-reader", "default", readerAccount)

	if code, b := scrape(""); code != http.StatusUnauthorized {
		t.Errorf("no token: %d %q, want 401", code, b)
	}
	if code, b := scrape("not-a-token"); code != http.StatusUnauthorized {
		t.Errorf("a token the API server did not issue: %d %q, want 401", code, b)
	}
	if code, b := scrape(stranger); code != http.StatusForbidden {
		t.Errorf("a service account without the reader role: %d %q, want 403", code, b)
	}
	// RBAC's authorizer sees a new binding within moments; a denial is cached for seconds.
	if err := testutil.Poll(60*time.Second, 500*time.Millisecond, func() error {
		if code, b := scrape(reader); code != http.StatusOK || b != body {
			return testutil.NotYet("the reader: %d %q, want 200 %q", code, b, body)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if code, b := scrape(stranger); code != http.StatusForbidden {
		t.Errorf("a service account without the reader role, after the reader's scrape: %d %q, want 403", code, b)
	}
}

// applyRBAC creates the objects of deploy/rbac/metrics' files, and the agent's service account.
func applyRBAC(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, files ...string) {
	t.Helper()
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	rbac := cp.Client.RbacV1()
	for _, f := range files {
		data, err := os.ReadFile(filepath.Join(root, "deploy", "rbac", "metrics", f))
		if err != nil {
			t.Fatal(err)
		}
		for _, doc := range strings.Split(string(data), "\n---\n") {
			var meta metav1.TypeMeta
			if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
				t.Fatal(err)
			}
			switch meta.Kind {
			case "ClusterRole":
				var o rbacv1.ClusterRole
				decode(t, doc, &o)
				_, err = rbac.ClusterRoles().Create(ctx, &o, metav1.CreateOptions{})
			case "ClusterRoleBinding":
				var o rbacv1.ClusterRoleBinding
				decode(t, doc, &o)
				_, err = rbac.ClusterRoleBindings().Create(ctx, &o, metav1.CreateOptions{})
			default:
				t.Fatalf("%s: unexpected %s", f, meta.Kind)
			}
			if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
		}
	}
}

func decode(t *testing.T, doc string, o any) {
	t.Helper()
	if err := yaml.UnmarshalStrict([]byte(doc), o); err != nil {
		t.Fatal(err)
	}
}

// serviceAccountToken creates the service account and returns a token of it (TokenRequest).
func serviceAccountToken(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, ns, name string) string {
	t.Helper()
	sas := cp.Client.CoreV1().ServiceAccounts(ns)
	if _, err := sas.Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tr, err := sas.CreateToken(ctx, name, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return tr.Status.Token
}

// bind binds the cluster role to the service account.
func bind(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, role, ns, account string) {
	t.Helper()
	_, err := cp.Client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: role + "-" + account},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: account, Namespace: ns}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
}

// TLSConfig serves the files' certificate when both are named, refuses one without the other,
// and makes a certificate of its own when none is.
func TestTLSConfig(t *testing.T) {
	dir := t.TempDir()
	certPEM, keyPEM, err := certutil.GenerateSelfSignedCertKey("agent.example", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	if err := os.WriteFile(certFile, certPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, keyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := metrics.TLSConfig(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	if cn := c.Certificates[0].Leaf.Subject.CommonName; !strings.HasPrefix(cn, "agent.example@") {
		t.Errorf("served %q, want the file's agent.example@...", cn)
	}
	if _, err := metrics.TLSConfig(certFile, ""); err == nil {
		t.Error("a certificate without its key: no error")
	}
	if c, err := metrics.TLSConfig("", ""); err != nil || len(c.Certificates) != 1 {
		t.Errorf("self-signed: %v", err)
	}
}
