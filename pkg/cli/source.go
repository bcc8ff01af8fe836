package cli

import (
	"flag"
	"fmt"
	"log/slog"
	"sync"

	"k8s.io/client-go/rest"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/apisource"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/configwatch"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/podsource"
)

// sourceFile is the --config-source of the mounted file (or directory), the default.
const sourceFile = "file"

// sourceFlags say where the agent's configuration comes from, and how it reaches the API server
// when it needs to.
type sourceFlags struct {
	source     string
	kubeconfig string

	restOnce sync.Once
	rest     *rest.Config
	restErr  error
}

func (f *sourceFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.source, "config-source", sourceFile, "where the configuration comes from: file (--config, as the kubelet mounts the ConfigMap), "+
		"configmap[:NAMESPACE/NAME] (watched through the API server, default "+kube.DefaultConfigMapNamespace+"/"+kube.DefaultConfigMapName+
		", key "+kube.ConfigMapKey+"), or crd[:NAME] (an "+kube.Configs.Kind+", default "+kube.DefaultConfigName+")")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file of the API server; empty means the pod's service account")
}

// object returns the API object --config-source names, ok false for the file.
func (f *sourceFlags) object() (apisource.Object, bool, error) {
	if f.source == sourceFile {
		return apisource.Object{}, false, nil
	}
	o, err := apisource.ParseObject(f.source)
	if err != nil {
		return o, false, usageError{err}
	}
	return o, true, nil
}

// restConfig is the API server's client configuration, made once.
func (f *sourceFlags) restConfig(log *slog.Logger) (*rest.Config, error) {
	f.restOnce.Do(func() {
		kube.LogTo(log)
		f.rest, f.restErr = kube.Config(f.kubeconfig)
	})
	return f.rest, f.restErr
}

// open returns the configuration source the flags name: the file or directory at path, or the
// API object, read for the node named node (its place in a rollout's waves).
func (f *sourceFlags) open(path string, copts config.Options, node string, log *slog.Logger) (config.Source, error) {
	obj, api, err := f.object()
	if err != nil {
		return nil, err
	}
	if !api {
		return configwatch.New(path, configwatch.Options{Config: copts, Logger: log})
	}
	cfg, err := f.restConfig(log)
	if err != nil {
		return nil, fmt.Errorf("config-source %s: %w", f.source, err)
	}
	return apisource.New(cfg, obj, apisource.Options{Config: copts, Node: node, Logger: log})
}

// pods returns the watcher of the node's pods that source rules with selectors need, or, when
// the agent cannot reach the API server, nil and why (with how to run it so that it can): the
// agent then rejects a configuration that selects pods. It needs the node's name and a client:
// --kubeconfig, or the pod's service account, as --config-source=configmap or crd does.
func (f *sourceFlags) pods(node string, log *slog.Logger) (*podsource.Watcher, string) {
	const how = "run the agent with --config-source=configmap or crd (or --kubeconfig), with --node-name or $NODE_NAME set"
	if node == "" {
		return nil, how + ": no --node-name, and NODE_NAME is not set"
	}
	cfg, err := f.restConfig(log)
	if err != nil {
		return nil, how + ": " + err.Error()
	}
	w, err := podsource.New(cfg, podsource.Options{Node: node, Logger: log})
	if err != nil {
		return nil, how + ": " + err.Error()
	}
	return w, ""
}
