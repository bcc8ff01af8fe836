package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpfbackend"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/metrics"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/version"
)

// agentFlags are the flags of the agent itself, beyond the policy flags.
type agentFlags struct {
	policyFlags
	backend        string
	interfaces     string
	metricsAddress string
	bpffs          string
	attachMode     string
	verbosity      int
	driftInterval  time.Duration
	sweepInterval  time.Duration
	natTimeouts    string
}

func (f *agentFlags) register(fs *flag.FlagSet) {
	f.policyFlags.register(fs)
	fs.StringVar(&f.backend, "backend", "auto", "datapath: auto (BPF when the kernel supports it, else iptables), bpf or iptables")
	fs.StringVar(&f.interfaces, "interfaces", "", "comma-separated uplinks to masquerade on (default: the devices of the default routes)")
	fs.StringVar(&f.metricsAddress, "metrics-address", ":9743", "HOST:PORT serving /metrics, /healthz and /readyz; empty disables")
	fs.StringVar(&f.bpffs, "bpffs", "/sys/fs/bpf", "BPF filesystem where maps and links are pinned")
	fs.StringVar(&f.attachMode, "attach-mode", "auto", "how the BPF backend attaches its programs: auto (tcx where the kernel has it, else tc), tcx, or tc (clsact and cls_bpf)")
	fs.DurationVar(&f.driftInterval, "drift-check-interval", agent.DefaultDriftInterval, "how often to check that the installed datapath is intact and repair it when not; 0 leaves the repair to the resync")
	fs.DurationVar(&f.sweepInterval, "nat-sweep-interval", bpfbackend.DefaultSweepInterval, "how often the BPF backend removes idle NAT entries")
	fs.StringVar(&f.natTimeouts, "nat-timeouts", "", `idle timeouts of BPF NAT entries, overriding the defaults, e.g. "udp=30s,tcp-closing=10s" (keys: `+strings.Join(timeoutKeys(), ", ")+")")
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

// timeoutFields are the keys of --nat-timeouts and the timeout each sets.
func timeoutFields(t *bpf.Timeouts) map[string]*time.Duration {
	return map[string]*time.Duration{
		"tcp-established": &t.TCPEstablished, "tcp-opening": &t.TCPOpening, "tcp-closing": &t.TCPClosing,
		"udp": &t.UDP, "icmp": &t.ICMP, "other": &t.Other,
	}
}

func timeoutKeys() []string {
	return slices.Sorted(maps.Keys(timeoutFields(&bpf.Timeouts{})))
}

// parseTimeouts reads --nat-timeouts: KEY=DURATION pairs, separated by commas, over the
// defaults.
func parseTimeouts(s string) (bpf.Timeouts, error) {
	t := bpf.DefaultTimeouts
	fields := timeoutFields(&t)
	for _, kv := range strings.Split(s, ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		field, known := fields[strings.TrimSpace(k)]
		if !ok || !known {
			return t, fmt.Errorf("nat-timeouts: %q: want KEY=DURATION with KEY one of %s", kv, strings.Join(timeoutKeys(), ", "))
		}
		d, err := time.ParseDuration(strings.TrimSpace(v))
		if err != nil || d <= 0 {
			return t, fmt.Errorf("nat-timeouts: %q: want a positive duration such as 30s", kv)
		}
		*field = d
	}
	return t, nil
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
	if err := tc.CheckMode(af.attachMode); err != nil {
		return usageError{err}
	}
	if af.sweepInterval <= 0 {
		return usageError{fmt.Errorf("nat-sweep-interval %v: must be positive", af.sweepInterval)}
	}
	if af.driftInterval < 0 {
		return usageError{fmt.Errorf("drift-check-interval %v: must be positive, or 0 to turn the checks off", af.driftInterval)}
	}
	timeouts, err := parseTimeouts(af.natTimeouts)
	if err != nil {
		return usageError{err}
	}
	log := newLogger(stderr, af.verbosity)
	log.Info("starting", "component", "cli", "version", version.String(), "config", af.configPath, "backend", af.backend)
	dp, err := newBackend(ctx, af.backend, &af, timeouts, log)
	if err != nil {
		return err
	}
	defer func() {
		if err := dp.close(); err != nil {
			log.Warn("release the datapath", "component", "cli", "error", err)
		}
	}()
	drift := af.driftInterval
	if drift == 0 {
		drift = -1 // off (the agent's zero is its default)
	}
	a, err := agent.New(agent.Options{ConfigPath: af.configPath, ConfigOptions: copts, PolicyOptions: popts,
		Backend: dp.backend, Logger: log, Changes: dp.changes, Displace: dp.displace, DriftInterval: drift})
	if err != nil {
		return err
	}
	reg, err := metrics.NewRegistry(metrics.Options{Backend: dp.backend, Agent: a, Logger: log})
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

// chosenBackend is the datapath the agent runs, and what goes with it.
type chosenBackend struct {
	backend datapath.Backend
	// displace are the other backends, removed once this one holds a policy.
	displace []agent.Displaced
	// changes are the backend's events (uplink changes), nil when it has none.
	changes <-chan string
	close   func() error
}

// newBackend returns the datapath backend that --backend names. auto takes BPF when the node can
// run it (probed: a BPF filesystem at --bpffs, programs the kernel loads), else iptables, and
// logs why.
func newBackend(ctx context.Context, name string, af *agentFlags, timeouts bpf.Timeouts, log *slog.Logger) (*chosenBackend, error) {
	switch name {
	case "auto", bpfbackend.Name:
		b, err := bpfbackend.New(ctx, bpfbackend.Options{BPFFS: af.bpffs, Interfaces: af.interfaceList(),
			EnableIPv6: af.enableIPv6, AttachMode: af.attachMode, SweepInterval: af.sweepInterval, Timeouts: timeouts,
			Logger: log})
		if err == nil {
			log.Info("datapath chosen", "component", "cli", "backend", bpfbackend.Name, "attachMode", b.Mode())
			return &chosenBackend{backend: b, displace: iptablesToDisplace(ctx, af, log), changes: b.Changes(), close: b.Close}, nil
		}
		if name == bpfbackend.Name {
			return nil, fmt.Errorf("backend bpf: %w", err)
		}
		log.Warn("the BPF datapath cannot run here; using iptables", "component", "cli", "reason", err)
	case iptables.Name:
	default:
		return nil, usageError{fmt.Errorf("backend %q: must be auto, bpf or iptables", name)}
	}
	if len(af.interfaceList()) > 0 {
		// MASQUERADE takes the address of whichever device a packet leaves by.
		log.Info("the iptables backend masquerades on every uplink; --interfaces is ignored", "component", "cli")
	}
	b, err := iptables.New(ctx, iptables.Options{Chain: af.masqChain, Logger: log})
	if err != nil {
		return nil, err
	}
	log.Info("datapath chosen", "component", "cli", "backend", iptables.Name)
	return &chosenBackend{backend: b, displace: []agent.Displaced{bpfbackend.Cleaner{BPFFS: af.bpffs, Logger: log}},
		close: func() error { return nil }}, nil
}

// iptablesToDisplace returns the iptables backend for the BPF backend to remove, or none when
// the node has no iptables tools (then nothing can have installed a chain through them).
func iptablesToDisplace(ctx context.Context, af *agentFlags, log *slog.Logger) []agent.Displaced {
	// A fixed mode skips detection: its Cleanup covers both modes anyway.
	var errs []error
	for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		b, err := iptables.New(ctx, iptables.Options{Chain: af.masqChain, Mode: mode, Logger: log})
		if err == nil {
			return []agent.Displaced{b}
		}
		errs = append(errs, err)
	}
	log.Debug("no iptables tools: no chain to remove", "component", "cli", "error", errors.Join(errs...))
	return nil
}

// newLogger logs text to stderr; --v 4 or more adds debug messages, as klog's verbosity did.
func newLogger(stderr io.Writer, verbosity int) *slog.Logger {
	level := slog.LevelInfo
	if verbosity >= 4 {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
}
