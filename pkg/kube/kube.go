// Package kube is the agent's Kubernetes API: the one definition of its API group and the
// resources in it (the IPMasqAgentConfig that carries the configuration, the IPMasqAgentNode
// each agent publishes its status in), the ConfigMap key it reads, and the client every part of
// the agent that talks to the API server shares.
package kube

import (
	"context"
	"fmt"
	"log/slog"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/version"
)

// The agent's API group and its version.
const (
	Group   = "ip-masq-agent.github.io"
	Version = "v1alpha1"
)

// Resources of the agent's API group: each a cluster-scoped custom resource whose
// CustomResourceDefinition is in deploy/crds.
var (
	// Configs are IPMasqAgentConfigs: the configuration's keys under spec, as a ConfigMap's
	// file holds them.
	Configs = Resource{Kind: "IPMasqAgentConfig", Plural: "ipmasqagentconfigs"}
	// Nodes are IPMasqAgentNodes: each node's agent publishes what it applied in the status of
	// the one named after the node.
	Nodes = Resource{Kind: "IPMasqAgentNode", Plural: "ipmasqagentnodes"}
)

// Resource is a resource of the agent's API group.
type Resource struct {
	Kind, Plural string
}

// GVR is the resource's group, version and plural name, for the dynamic client.
func (r Resource) GVR() schema.GroupVersionResource {
	return schema.GroupVersionResource{Group: Group, Version: Version, Resource: r.Plural}
}

// APIVersion is what the resource's objects carry as apiVersion.
func (r Resource) APIVersion() string { return Group + "/" + Version }

// CRDName is the name of the resource's CustomResourceDefinition.
func (r Resource) CRDName() string { return r.Plural + "." + Group }

// ConfigMapKey is the key of the ConfigMap that holds the configuration file: the upstream
// agent's, which its DaemonSet mounts as the file ip-masq-agent.
const ConfigMapKey = "config"

// Default names of the objects the agent reads.
const (
	DefaultConfigMapNamespace = "kube-system"
	DefaultConfigMapName      = "ip-masq-agent"
	DefaultConfigName         = "default"
)

// Client limits: the agent reads one object through a watch and writes its status rarely, so
// a low rate is plenty; the limit keeps a fleet of agents in a retry loop from hurting the API
// server.
const (
	clientQPS   = 5
	clientBurst = 10
)

// Config returns the client configuration: from the kubeconfig file when one is named, else the
// pod's service account (in-cluster). Every request says it comes from this agent and version.
func Config(kubeconfig string) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("kubeconfig %s: %w", kubeconfig, err)
		}
	} else if cfg, err = rest.InClusterConfig(); err != nil {
		return nil, fmt.Errorf("no --kubeconfig, and not in a pod with a service account: %w", err)
	}
	cfg.UserAgent = "ip-masq-agent/" + version.Version
	cfg.QPS, cfg.Burst = clientQPS, clientBurst
	return cfg, nil
}

// LogTo sends client-go's own logs (klog) to log, as debug messages (the agent's --v=4): what
// they tell, a watch that ended or a request that failed, the agent reports itself.
func LogTo(log *slog.Logger) {
	klog.SetSlogLogger(slog.New(debugOnly{log.Handler()}).With("component", "client-go"))
}

// debugOnly logs every record at the debug level.
type debugOnly struct{ slog.Handler }

func (h debugOnly) Enabled(ctx context.Context, _ slog.Level) bool {
	return h.Handler.Enabled(ctx, slog.LevelDebug)
}

func (h debugOnly) Handle(ctx context.Context, r slog.Record) error {
	r.Level = slog.LevelDebug
	return h.Handler.Handle(ctx, r)
}

func (h debugOnly) WithAttrs(attrs []slog.Attr) slog.Handler {
	return debugOnly{h.Handler.WithAttrs(attrs)}
}
func (h debugOnly) WithGroup(name string) slog.Handler { return debugOnly{h.Handler.WithGroup(name)} }
