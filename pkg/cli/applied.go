package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nodelock"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// The running agent answers the node lock's configQuery (nodelock.Ask) with the configuration it
// applied, so that explain and dump, run beside it (kubectl exec into its pod), read what the
// node runs whatever the agent's --config-source: a file, a ConfigMap or an API object. The lock
// is the node's one agent, found in the network namespace without flags, and its socket is
// local: the configuration is not served on the metrics port.

// configQuery is the node lock query the agent answers with its appliedConfig.
const configQuery = "config"

// appliedConfig is the agent's answer to configQuery: the configuration in force, in canonical
// form (config.Config.Canonical), the flags that made its policy, and where it came from.
type appliedConfig struct {
	// Source names where the agent reads its configuration: "file PATH", or the API object
	// ("configmap NAMESPACE/NAME", "ipmasqagentconfig NAME").
	Source string `json:"source"`
	// SHA256 is the configuration's hash (the ip_masq_agent_config_info metric's); Generation
	// and ResourceVersion the API object's it was read from, when it was.
	SHA256          string          `json:"sha256"`
	ResourceVersion string          `json:"resourceVersion,omitempty"`
	Generation      int64           `json:"generation,omitempty"`
	EnableIPv6      bool            `json:"enableIPv6"`
	RandomFully     bool            `json:"randomFully"`
	ToPorts         string          `json:"toPorts,omitempty"`
	Config          json.RawMessage `json:"config"`
	// Pods are the node's pods the source rules select, by rule name (agent.Applied.Pods).
	Pods map[string][]netip.Addr `json:"pods,omitempty"`
}

// answerConfig makes the node lock answer configQuery with what a applied.
func answerConfig(lock *nodelock.Lock, a *agent.Agent, source string, pf policyFlags) {
	lock.Answer(configQuery, func() (any, error) {
		ap, ok := a.Applied()
		if !ok {
			return nil, errors.New("no configuration applied yet")
		}
		return appliedConfig{Source: source, SHA256: ap.SHA256, ResourceVersion: ap.Revision.ResourceVersion,
			Generation: ap.Revision.Generation, EnableIPv6: pf.enableIPv6, RandomFully: pf.randomFully,
			ToPorts: pf.toPorts, Config: ap.Config.Canonical(), Pods: ap.Pods}, nil
	})
}

// sourceName is appliedConfig.Source for the flags.
func (f *agentFlags) sourceName() string {
	if obj, api, err := f.object(); err == nil && api {
		return obj.String()
	}
	return "file " + f.configPath
}

// policy compiles the answer's configuration with the agent's flags.
func (ac appliedConfig) policy() (*policy.Policy, error) {
	cfg, err := config.Parse(ac.Config, config.Options{EnableIPv6: ac.EnableIPv6})
	if err != nil {
		return nil, fmt.Errorf("the running agent's configuration: %w", err)
	}
	ports, err := policy.ParsePortRanges(ac.ToPorts)
	if err != nil {
		return nil, fmt.Errorf("the running agent's --to-ports: %w", err)
	}
	return policy.Compile(cfg, policy.Options{EnableIPv6: ac.EnableIPv6, RandomFully: ac.RandomFully, ToPorts: ports,
		Pods: ac.Pods}), nil
}

// describe is the "config:" line of an answer.
func (ac appliedConfig) describe() string {
	s := "config: applied by the running agent (source: " + ac.Source
	if ac.Generation > 0 {
		s += fmt.Sprintf(", generation %d", ac.Generation)
	}
	if ac.ResourceVersion != "" {
		s += ", resourceVersion " + ac.ResourceVersion
	}
	if len(ac.SHA256) >= 12 {
		s += ", sha256 " + ac.SHA256[:12]
	}
	return s + ")"
}

// registerFromFile registers --from-file (explain and dump): set, the command reads --config
// whether or not the running agent answers.
func registerFromFile(fs *flagSet, fromFile *bool) {
	fs.BoolVar(fromFile, "from-file", false, "read the configuration of --config, not the one the node's running agent applied (which is read by default, when an agent answers)")
}

// lockNameKey is the context key of the node lock that livePolicy asks: the unit tests' own, in
// the host's namespace; nodelock.Name where none is set.
type lockNameKey struct{}

func lockName(ctx context.Context) string {
	if name, ok := ctx.Value(lockNameKey{}).(string); ok {
		return name
	}
	return nodelock.Name
}

// livePolicy is the policy the node runs: the one of the configuration the running agent
// applied, or where no agent answers (or fromFile is set), the one of the flags' file. It
// returns the "config:" line saying which, which explain and dump write to stderr: a note beside
// their tables.
func (f *policyFlags) livePolicy(ctx context.Context, fromFile bool) (*policy.Policy, string, error) {
	why := "--from-file"
	if !fromFile {
		var ac appliedConfig
		h, err := nodelock.Ask(lockName(ctx), configQuery, &ac)
		if err == nil {
			p, err := ac.policy()
			return p, ac.describe(), err
		}
		why = "no running agent answered"
		if h != (nodelock.Holder{}) {
			why += ": " + err.Error() // the holder's answer, or why it gave none
		}
	}
	p, err := f.load()
	return p, "config: file " + f.configPath + " (" + why + ")", err
}
