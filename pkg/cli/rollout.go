package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"k8s.io/client-go/rest"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/metrics"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/rollout"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/version"
)

// rolloutFlags are the rollout controller's.
type rolloutFlags struct {
	name, waves, strategy   string
	hold, deadline          time.Duration
	kubeconfig              string
	metricsAddress          string
	metricsSecure           bool
	metricsCert, metricsKey string
	verbosity               int
}

// Strategies of --strategy.
const (
	strategyWaves     = "waves"
	strategyImmediate = "immediate"
)

// runRollout runs the rollout controller: one per cluster (a Deployment of one replica), which
// rolls each new generation of an IPMasqAgentConfig out in waves.
func runRollout(ctx context.Context, args []string, _, stderr io.Writer) error {
	var f rolloutFlags
	fs := newFlagSet(commandNamed("rollout"), stderr)
	fs.group("rollout", func() {
		fs.StringVar(&f.name, "config-name", kube.DefaultConfigName, "the "+kube.Configs.Kind+" whose generations are rolled out (the agents' --config-source=crd:NAME)")
		fs.StringVar(&f.strategy, "strategy", strategyWaves, "waves: each new generation goes out in --waves, each after the previous one's nodes applied it and stayed well for --hold; immediate: to every node at once")
		fs.StringVar(&f.waves, "waves", rollout.DefaultWaves, "the cumulative shares of the nodes each wave releases, in percent, ending at 100; each wave releases at least one node more")
		fs.DurationVar(&f.hold, "hold", rollout.DefaultHold, "how long a wave's nodes must stay well after applying the generation before the next wave")
		fs.DurationVar(&f.deadline, "deadline", rollout.DefaultDeadline, "how long a wave's nodes have to apply the generation before the rollout halts")
		fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file of the API server; empty means the pod's service account")
		fs.StringVar(&f.metricsAddress, "metrics-address", ":9745", "where to serve /metrics and /healthz; empty serves nothing")
		fs.BoolVar(&f.metricsSecure, "metrics-secure", false, "serve HTTPS, and /metrics only to clients the API server authenticates and authorizes (as the agent's --metrics-secure)")
		fs.StringVar(&f.metricsCert, "metrics-cert-file", "", "PEM certificate of --metrics-secure; empty means a self-signed one made at start")
		fs.StringVar(&f.metricsKey, "metrics-key-file", "", "PEM private key of --metrics-cert-file")
		fs.IntVar(&f.verbosity, "v", 0, "log verbosity; 4 or more logs debug messages")
	})
	if err := parseNoArgs(fs.FlagSet, args); err != nil {
		return err
	}
	plan, err := f.plan()
	if err != nil {
		return err
	}
	log := newLogger(stderr, f.verbosity)
	kube.LogTo(log)
	cfg, err := kube.Config(f.kubeconfig)
	if err != nil {
		return err
	}
	log.Info("starting the rollout controller", "component", "cli", "version", version.String(), "config", f.name, "strategy", f.strategy)
	c, err := rollout.New(cfg, rollout.Options{Name: f.name, Plan: plan, Logger: log})
	if err != nil {
		return err
	}
	if f.metricsAddress != "" {
		reg, err := metrics.NewRolloutRegistry(c.State)
		if err != nil {
			return fmt.Errorf("metrics: %w", err)
		}
		mux := http.NewServeMux()
		mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
		h, ln, err := listenMetrics(ctx, f.metricsAddress, f.metricsSecure, f.metricsCert, f.metricsKey, metrics.Handler(reg, log),
			func() (*rest.Config, error) { return cfg, nil }, log)
		if err != nil {
			return err
		}
		mux.Handle("GET "+metrics.Path, h)
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("metrics server", "component", "cli", "error", err)
			}
		}()
		defer srv.Close()
	}
	return c.Run(ctx)
}

// plan is the rollout plan the flags describe.
func (f *rolloutFlags) plan() (rollout.Plan, error) {
	waves, err := rollout.ParseWaves(f.waves)
	if err != nil {
		return rollout.Plan{}, usageError{err}
	}
	p := rollout.Plan{Waves: waves, Hold: f.hold, Deadline: f.deadline}
	switch f.strategy {
	case strategyWaves:
	case strategyImmediate:
		p.Immediate = true
	default:
		return p, usageError{fmt.Errorf("strategy %q: want %s or %s", f.strategy, strategyWaves, strategyImmediate)}
	}
	if f.hold < 0 || f.deadline <= 0 {
		return p, usageError{fmt.Errorf("hold %v, deadline %v: want a hold of 0 or more and a positive deadline", f.hold, f.deadline)}
	}
	if f.metricsCert+f.metricsKey != "" && (!f.metricsSecure || f.metricsCert == "" || f.metricsKey == "") {
		return p, usageError{errors.New("metrics-cert-file and metrics-key-file go together, with --metrics-secure")}
	}
	return p, nil
}
