package cli

import (
	"context"
	"crypto/tls"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/configwatch"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/metrics"
)

// With --metrics-secure the agent's endpoint answers HTTPS: /healthz and /readyz to anyone (the
// kubelet's probes carry no token), /metrics to no request without a token. Whom the API server
// lets scrape is pkg/metrics' TestProtectAgainstAnAPIServer; here the API server is never reached.
func TestSecureMetricsEndpoint(t *testing.T) {
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600); err != nil {
		t.Fatal(err)
	}
	af := &agentFlags{metricsAddress: "127.0.0.1:0", metricsSecure: true}
	af.kubeconfig = kubeconfig
	b := &datapathtest.Backend{}
	src, err := configwatch.NewFile(filepath.Join(dir, "none"), configwatch.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(agent.Options{Source: src, Backend: b})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ln, err := af.serveMetrics(ctx, a, metrics.Options{Backend: b, Agent: a}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx, ln) }()
	defer func() {
		cancel()
		<-done
	}()
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	get := func(path string) (int, error) {
		resp, err := client.Get("https://" + ln.Addr().String() + path)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	if err := testutil.Poll(10*time.Second, 10*time.Millisecond, func() error {
		if code, err := get("/readyz"); err != nil || code != http.StatusOK {
			return testutil.NotYet("/readyz: %d %v", code, err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if code, err := get("/healthz"); err != nil || code != http.StatusOK {
		t.Errorf("/healthz: %d %v, want 200", code, err)
	}
	if code, err := get(metrics.Path); err != nil || code != http.StatusUnauthorized {
		t.Errorf("%s without a token: %d %v, want 401", metrics.Path, code, err)
	}
	if resp, err := http.Get("http://" + ln.Addr().String() + "/healthz"); err == nil && resp.StatusCode == http.StatusOK {
		resp.Body.Close()
		t.Error("plain HTTP is served")
	}
}
