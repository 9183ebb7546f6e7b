// What a runcap dashboard must be, in Grafana's own types (@grafana/schema, the types Grafana's
// frontend uses) and the ClickHouse data source plugin's query model. tests/test_dashboard_schema.py
// writes each dashboards/*.json as a TypeScript literal that `satisfies RuncapDashboard` (and
// Grafana's plain `Dashboard`) and runs `tsc --noEmit`: an unknown panel type, a misspelt or
// mistyped option, field config or query field fails the suite.

import type { Dashboard, DataQuery, FieldConfigSource, Panel, VariableModel } from '@grafana/schema';
import type * as barchart from '@grafana/schema/dist/esm/raw/composable/barchart/panelcfg/x/BarChartPanelCfg_types.gen';
import type * as piechart from '@grafana/schema/dist/esm/raw/composable/piechart/panelcfg/x/PieChartPanelCfg_types.gen';
import type * as stat from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';
import type * as table from '@grafana/schema/dist/esm/raw/composable/table/panelcfg/x/TablePanelCfg_types.gen';
import type * as timeseries from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';

// -- JSON ------------------------------------------------------------------------------------
// A type as its JSON reads: Grafana's string enums (SortOrder, LegendDisplayMode, ...) become the
// union of their values, which is what a dashboard file holds and what Grafana compares with.
export type Json<T> = T extends string
  ? string extends T
    ? string
    : `${T}`
  : T extends readonly (infer U)[]
    ? Json<U>[]
    : T extends object
      ? { [K in keyof T]: Json<T[K]> }
      : T;

// -- the ClickHouse data source plugin (grafana-clickhouse-datasource 4.x) ---------------------
// Its SQL editor's query is `CHSqlQuery` (src/types/sql.ts): editorType 'sql', rawSql, an optional
// queryType ('table' | 'logs' | 'timeseries' | 'traces', src/types/queryBuilder.ts) and `format`,
// the sqlds frame format the backend reads, which the editor derives from the query type
// (mapQueryTypeToGrafanaFormat in src/data/utils.ts: timeseries 0, table 1, logs 2, traces 3).
// pluginVersion is required there but filled in by the plugin when it loads a saved query.

export interface ClickHouseRef {
  type: 'grafana-clickhouse-datasource';
  uid: string;
}

export type ClickHouseQueryType = 'table' | 'logs' | 'timeseries' | 'traces';

type FormatOfQueryType =
  | { queryType: 'timeseries'; format: 0 }
  | { queryType: 'table'; format: 1 }
  | { queryType: 'logs'; format: 2 }
  | { queryType: 'traces'; format: 3 };

export interface ClickHouseSqlQuery extends Omit<DataQuery, 'queryType' | 'datasource'> {
  datasource?: ClickHouseRef;
  editorType: 'sql';
  rawSql: string;
  queryType?: ClickHouseQueryType;
  format?: number;
  pluginVersion?: string;
  meta?: { timezone?: string };
  expand?: boolean;
}

// A panel's query: a SQL-editor query whose format is the one its query type gives.
export type ClickHouseTarget = ClickHouseSqlQuery & { datasource: ClickHouseRef } & FormatOfQueryType;

// A query variable's query: the same model, without format (a variable reads one column).
export type ClickHouseVariableQuery = Omit<ClickHouseSqlQuery, 'format'>;

// -- panels ------------------------------------------------------------------------------------

// Grafana's field config, with `custom` typed by the panel plugin's FieldConfig.
type FieldConfigOf<Custom> = Omit<FieldConfigSource, 'defaults'> & {
  defaults: Omit<FieldConfigSource['defaults'], 'custom'> & { custom?: Partial<Custom> };
};

// Grafana's Panel, with the type, options and field config of one panel plugin and the
// ClickHouse plugin's queries. Options are partial: Grafana fills in the plugin's defaults.
type PanelOf<Type extends string, Options, Custom> = Omit<
  Panel,
  'type' | 'options' | 'fieldConfig' | 'targets' | 'datasource'
> & {
  type: Type;
  datasource: ClickHouseRef;
  options?: Partial<Options>;
  fieldConfig?: FieldConfigOf<Custom>;
  targets: ClickHouseTarget[];
};

// The panel types runcap's dashboards use (each one a core Grafana panel plugin).
export type RuncapPanel =
  | PanelOf<'stat', stat.Options, Record<never, never>>
  | PanelOf<'timeseries', timeseries.Options, timeseries.FieldConfig>
  | PanelOf<'table', table.Options, table.FieldConfig>
  | PanelOf<'barchart', barchart.Options, barchart.FieldConfig>
  | PanelOf<'piechart', piechart.Options, piechart.FieldConfig>;

// -- variables and the dashboard ---------------------------------------------------------------

// Grafana's VariableModel for a query variable of the ClickHouse data source. `allValue` is null
// in the JSON Grafana saves when no custom "All" value is set.
export type RuncapVariable = Omit<VariableModel, 'type' | 'datasource' | 'query' | 'allValue'> & {
  type: 'query';
  datasource: ClickHouseRef;
  query: ClickHouseVariableQuery;
  allValue?: string | null;
};

export type RuncapDashboard = Json<
  Omit<Dashboard, 'panels' | 'templating'> & {
    panels: RuncapPanel[];
    templating: { list: RuncapVariable[] };
  }
>;

// Grafana's own Dashboard type, as JSON.
export type GrafanaDashboard = Json<Dashboard>;

// -- the data source, as dashboards/provisioning/datasources/clickhouse.yaml provisions it -----
// The plugin's settings (CHConfig in src/types/config.ts; the backend reads them in
// pkg/plugin/settings.go). `version` is written by the plugin when it saves its settings.

export interface ClickHouseJsonData {
  version?: string;
  host: string;
  port: number;
  protocol: 'native' | 'http';
  secure?: boolean;
  path?: string;
  tlsSkipVerify?: boolean;
  tlsAuth?: boolean;
  tlsAuthWithCACert?: boolean;
  username: string;
  defaultDatabase?: string;
  defaultTable?: string;
  connMaxLifetime?: string;
  dialTimeout?: string;
  maxIdleConns?: string;
  maxOpenConns?: string;
  queryTimeout?: string;
  validateSql?: boolean;
}

export interface ClickHouseSecureJsonData {
  password?: string;
  tlsCACert?: string;
  tlsClientCert?: string;
  tlsClientKey?: string;
}

// One entry of a provisioning file's `datasources` (Grafana's provisioning format).
export interface ClickHouseDatasource {
  name: string;
  uid: string;
  type: 'grafana-clickhouse-datasource';
  isDefault?: boolean;
  editable?: boolean;
  jsonData: ClickHouseJsonData;
  secureJsonData?: ClickHouseSecureJsonData;
}
