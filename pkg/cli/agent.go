package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/metrics"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/version"
)

// agentFlags are the flags of the agent itself, beyond the policy flags.
type agentFlags struct {
	policyFlags
	backend        string
	interfaces     string
	metricsAddress string
	bpffs          string
	verbosity      int
}

func (f *agentFlags) register(fs *flag.FlagSet) {
	f.policyFlags.register(fs)
	fs.StringVar(&f.backend, "backend", "auto", "datapath: auto (BPF when the kernel supports it, else iptables), bpf or iptables")
	fs.StringVar(&f.interfaces, "interfaces", "", "comma-separated uplinks to masquerade on (default: the devices of the default routes)")
	fs.StringVar(&f.metricsAddress, "metrics-address", ":9808", "HOST:PORT serving /metrics, /healthz and /readyz; empty disables")
	fs.StringVar(&f.bpffs, "bpffs", "/sys/fs/bpf", "BPF filesystem where maps and links are pinned")
	// Accepted so that upstream manifests keep working: klog verbosity (4 and above log debug).
	fs.IntVar(&f.verbosity, "v", 0, "log verbosity; 4 or more logs debug messages")
	fs.Bool("logtostderr", true, "ignored: logs always go to stderr (accepted for upstream manifests)")
}

func (f *agentFlags) interfaceList() []string {
	var out []string
	for _, s := range strings.Split(f.interfaces, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

func runAgent(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var af agentFlags
	fs := newFlagSet("ip-masq-agent", "ip-masq-agent [flags]", stderr)
	af.register(fs)
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageError{errors.New("the agent takes no arguments; subcommands: explain, render, dump, cleanup, version")}
	}
	copts, popts, err := af.options()
	if err != nil {
		return err
	}
	log := newLogger(stderr, af.verbosity)
	log.Info("starting", "component", "cli", "version", version.String(), "config", af.configPath, "backend", af.backend)
	backend, err := newBackend(ctx, af.backend, &af, log)
	if err != nil {
		return err
	}
	a, err := agent.New(agent.Options{ConfigPath: af.configPath, ConfigOptions: copts, PolicyOptions: popts,
		Backend: backend, Logger: log})
	if err != nil {
		return err
	}
	reg, err := metrics.NewRegistry(metrics.Options{Backend: backend, Agent: a, Logger: log})
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	a.Mux().Handle("GET /metrics", metrics.Handler(reg, log))
	var ln net.Listener
	if af.metricsAddress != "" {
		// Listening before the loop starts makes a taken port an immediate, clear error.
		ln, err = (&net.ListenConfig{}).Listen(ctx, "tcp", af.metricsAddress)
		if err != nil {
			return fmt.Errorf("metrics-address: %w", err)
		}
	}
	return a.Run(ctx, ln)
}

// newBackend returns the datapath backend that --backend names.
func newBackend(ctx context.Context, name string, af *agentFlags, log *slog.Logger) (datapath.Backend, error) {
	switch name {
	case "auto", iptables.Name:
		if len(af.interfaceList()) > 0 {
			// MASQUERADE takes the address of whichever device a packet leaves by.
			log.Info("the iptables backend masquerades on every uplink; --interfaces is ignored", "component", "cli")
		}
		return iptables.New(ctx, iptables.Options{Chain: af.masqChain, Logger: log})
	case "bpf":
		return nil, errors.New("backend bpf is not available in this build; use --backend=iptables (or auto)")
	default:
		return nil, usageError{fmt.Errorf("backend %q: must be auto, bpf or iptables", name)}
	}
}

// newLogger logs text to stderr; --v 4 or more adds debug messages, as klog's verbosity did.
func newLogger(stderr io.Writer, verbosity int) *slog.Logger {
	level := slog.LevelInfo
	if verbosity >= 4 {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
}
