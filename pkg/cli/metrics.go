package cli

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"

	"k8s.io/client-go/rest"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/metrics"
)

// listenMetrics serves h as --metrics-secure asks, for the agent and the rollout controller:
// with secure, only to the clients the API server (of restConfig) authenticates and
// authorizes, over TLS (cert and key, or a self-signed certificate); it listens on address
// before any loop starts, so that a taken port is an immediate, clear error.
func listenMetrics(ctx context.Context, address string, secure bool, cert, key string, h http.Handler,
	restConfig func() (*rest.Config, error), log *slog.Logger) (http.Handler, net.Listener, error) {
	var tlsConfig *tls.Config
	if secure {
		cfg, err := restConfig()
		if err != nil {
			return nil, nil, fmt.Errorf("metrics-secure: %w", err)
		}
		if h, err = metrics.Protect(h, cfg, log); err != nil {
			return nil, nil, fmt.Errorf("metrics-secure: %w", err)
		}
		if tlsConfig, err = metrics.TLSConfig(cert, key); err != nil {
			return nil, nil, fmt.Errorf("metrics-secure: %w", err)
		}
	}
	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", address)
	if err != nil {
		return nil, nil, fmt.Errorf("metrics-address: %w", err)
	}
	if tlsConfig != nil {
		ln = tls.NewListener(ln, tlsConfig)
	}
	return h, ln, nil
}
